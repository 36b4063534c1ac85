"""The guide's demo: a built-in shipping task and a fixed action, two events."""

from __future__ import annotations

import subprocess
import sys
import time

from .events import emit, record_outcome

BUGGY = "def shipping(total):\n    return 0 if total > 99 else 10\n"
TESTS = """import unittest

from shipping import shipping


class ShippingTest(unittest.TestCase):
    def test_below_threshold_pays_shipping(self):
        self.assertEqual(shipping(98), 10)

    def test_threshold_is_free(self):
        self.assertEqual(shipping(99), 0)

    def test_above_threshold_is_free(self):
        self.assertEqual(shipping(100), 0)


if __name__ == "__main__":
    unittest.main()
"""


def run_demo_tests() -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-B", "test_shipping.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout


def act(action: str) -> None:
    """The guide's stand-in for the agent's action."""
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "fix":
        with open("shipping.py") as handle:
            source = handle.read()
        with open("shipping.py", "w") as handle:
            handle.write(source.replace("total > 99", "total >= 99"))


def demo(action: str) -> int:
    with open("shipping.py", "w") as handle:
        handle.write(BUGGY)
    with open("test_shipping.py", "w") as handle:
        handle.write(TESTS)
    emit("ready")
    baseline_exit, _ = run_demo_tests()
    # Nothing but events goes to stdout or stderr: a Pod's log merges the two, and any other
    # line there is a protocol violation (validation fails the episode for it).
    if baseline_exit == 0:
        emit("error", kind="episode", cause="baseline tests passed; the task must start failing")
        return 3
    act(action)
    tests_exit, tests_output = run_demo_tests()
    reward = emit(
        "reward",
        reward=int(tests_exit == 0),
        baseline_exit=baseline_exit,
        tests_exit=tests_exit,
        tests_output=tests_output,
    )
    record_outcome(reward)
    return 0 if tests_exit == 0 else 1  # the reward event says why

"""One RL episode in a sandbox: prepare code and tests, act, test again, report a reward.

Runs with any Python >= 3.9 and only the standard library, as an unprivileged user, in its own
workspace. Its stdout carries exactly two JSON events (`ready`, `reward`); it is the record the
workers validate. The exit status is 0 only when the tests pass after the action.

Environment: EPISODE_ID (the sandbox's name), ROLLOUT_WORKSPACE (default /workspace),
ROLLOUT_ACTION (fix | none | hang; default fix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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
TERMINATION_LOG = "/dev/termination-log"


def emit(event: str, **data: object) -> dict[str, object]:
    record = {"event": event, "at": time.time(), "episode_id": os.environ["EPISODE_ID"]}
    record.update(data)
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
    return record


def run_tests() -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-B", "test_shipping.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout


def act(action: str) -> None:
    """Stand-in for the agent's action (a model's patch in a real rollout)."""
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "fix":
        with open("shipping.py") as handle:
            source = handle.read()
        with open("shipping.py", "w") as handle:
            handle.write(source.replace("total > 99", "total >= 99"))


def record_outcome(reward_event: dict[str, object]) -> None:
    # Kubernetes carries this file back in the Pod status: the outcome survives even if the
    # log stream is cut or never read.
    if os.path.exists(TERMINATION_LOG):
        summary = {
            k: reward_event[k]
            for k in ("at", "episode_id", "reward", "baseline_exit", "tests_exit")
        }
        try:
            with open(TERMINATION_LOG, "w") as handle:
                handle.write(json.dumps(summary))
        except OSError:
            pass


def main() -> int:
    workspace = os.environ.get("ROLLOUT_WORKSPACE", "/workspace")
    action = os.environ.get("ROLLOUT_ACTION", "fix")
    os.chdir(workspace)
    with open("shipping.py", "w") as handle:
        handle.write(BUGGY)
    with open("test_shipping.py", "w") as handle:
        handle.write(TESTS)
    emit("ready")
    baseline_exit, _ = run_tests()
    if baseline_exit == 0:
        sys.stderr.write("baseline tests passed; the task must start from a failing test\n")
        return 3
    act(action)
    tests_exit, tests_output = run_tests()
    reward = emit(
        "reward",
        reward=int(tests_exit == 0),
        baseline_exit=baseline_exit,
        tests_exit=tests_exit,
        tests_output=tests_output,
    )
    record_outcome(reward)
    if tests_exit != 0:
        sys.stderr.write("tests still fail after the action\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Harbor's multi-step tasks on the local cluster's real node, the Kubernetes twin of
test_harbor_steps.py: each step's agent and each step's tests run in containers of their own,
in order, over the Pod's workspace (kube/pod_steps.py), and the row is the local backend's
(`step_rewards`, the reward by the strategy). One batch: the fixture's oracle earns 1; an
agent right at step 1 and wrong at step 2 earns [1, 0], 0.5 under mean and 0 under final; one
wrong at step 1 stops at the fixture's min_reward (step 2's agent never runs); a peeking agent
and a peeking test find no later step's statement or tests, nor an earlier step's tests; a
planted reward file under tests that exit 0 earns each step 0."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from rollout_wire.harbor import scan
from tests.integration.test_red_team import NEVER_ASKED
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "harbor" / "multi-step" / "two-steps"
# Split so that no script holding the pattern matches itself.
LATER = "LATER" + "-STEP-" + "SECRET-5120"
EARLIER = "EARLIER" + "-TESTS-" + "SECRET-7734"
# Where a step's container could hold anything: its mounts, /tmp, the workspace, its root's
# usual places. What turns up is written to the workspace for the tests to judge.
LOOK = "/demo /rollout-step /rollout-steps /rollout-gate /handoff /tests /logs /solution"
LOOK += " /tmp /dev/shm /etc /run ."
# One command for both steps, told apart by the statement it is given.
RIGHT_THEN_WRONG = (
    'case "$ROLLOUT_STATEMENT" in *Append*) echo wrong >> step.txt;; *) echo one > step.txt;; esac'
)
WRONG = "echo wrong > step.txt"
PLANT = "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; echo 1 > step.txt"


def peek(out: str, *secrets: str) -> str:
    """Shell that greps every place for `secrets` (each split in two, so that no file holding
    this script matches) and writes `none` or what it found to `out`."""
    patterns = " ".join(f'-e "{s[:5]}""{s[5:]}"' for s in secrets)
    return (
        f'found=$(grep -rlsa {patterns} {LOOK} 2>/dev/null | grep -v "^./peek"); '
        f'if [ -z "$found" ]; then echo none; else echo "$found"; fi > {out}\n'
    )


def fixture() -> dict[str, Any]:
    (mapped,) = scan(FIXTURE)
    return mapped.task


def command(task_id: str, script: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    task = copy.deepcopy(base or fixture())
    return task | {"id": task_id, "agent": {"command": ["bash", "-c", script]}}


def peeking() -> dict[str, Any]:
    """Step 1's tests carry EARLIER, step 2's statement and tests LATER. Step 1's agent looks
    for both, step 1's tests (whose code under test could hand them on) for LATER, step 2's
    agent for EARLIER; each step pays 1 only if nothing turned up and the file is right."""
    task = fixture()
    first, second = task["steps"]
    pays = (
        'mkdir -p /logs/verifier\nif {check} && [ "$(cat step.txt)" = "{want}" ]; '
        "then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
    )
    first["tests"] = {
        "test.sh": f"#!/bin/bash\n# {EARLIER}\n"
        + peek("peek-t1.txt", LATER)
        + pays.format(
            check='[ "$(cat peek-1.txt)" = none ] && [ "$(cat peek-t1.txt)" = none ]', want="one"
        )
    }
    second["statement"] += f"\n{LATER}\n"
    second["tests"] = {
        "test.sh": f"#!/bin/bash\n# {LATER}\n"
        + pays.format(check='[ "$(cat peek-2.txt)" = none ]', want="$(printf 'one\\ntwo')")
    }
    script = (
        "if [ -f step.txt ]; then\n"
        + peek("peek-2.txt", EARLIER)
        + "echo two >> step.txt\nelse\n"
        + peek("peek-1.txt", LATER, EARLIER)
        + "echo one > step.txt\nfi\n"
    )
    return command("no-peek", script, task)


def exit_zero() -> dict[str, Any]:
    task = fixture()
    for step in task["steps"]:
        step["tests"] = {"test.sh": "#!/bin/bash\nexit 0\n"}
        step.pop("min_reward", None)
    return command("exit-zero", PLANT, task)


def test_steps_run_agent_tests_agent_tests_in_the_pods_containers(real_node, real_stack):
    final = fixture() | {"step_reward_strategy": "final"}
    tasks = [
        fixture() | {"agent": "oracle"},
        command("right-then-wrong", RIGHT_THEN_WRONG),
        command("right-then-wrong-final", RIGHT_THEN_WRONG, final),
        command("gated", WRONG),
        peeking(),
        exit_zero(),
    ]
    client = RolloutClient(real_stack.redis_url)
    began = time.monotonic()
    try:
        batch = client.submit(
            **real_node.batch_fields(),
            backend="kubernetes",
            tasks=tasks,
            samples_per_task=1,
            parallelism=len(tasks),
            policy=NEVER_ASKED,
            capacity_check="warn",
        )
        report = client.wait(batch.batch_id, timeout=300)
    finally:
        client.close()
    seconds = time.monotonic() - began
    rows = {r["task_id"]: r for r in report["pods"]}
    for row in rows.values():
        assert row["status"] == "ok" and not row["errors"], row

    def rewards(task: str) -> list[tuple[str, float]]:
        return [(s["name"], s["reward"]) for s in rows[task]["step_rewards"]]

    # The oracle earns full reward, each step its own.
    assert rewards("two-steps") == [("make-file", 1), ("extend-file", 1)]
    assert rows["two-steps"]["reward"] == 1
    # Step 1 right, step 2 wrong: the mean of both, or the last one's.
    assert rewards("right-then-wrong") == [("make-file", 1), ("extend-file", 0)]
    assert rows["right-then-wrong"]["reward"] == 0.5
    assert rows["right-then-wrong"]["grade_cause"] == "reward_file"
    assert rewards("right-then-wrong-final") == [("make-file", 1), ("extend-file", 0)]
    assert rows["right-then-wrong-final"]["reward"] == 0
    # Below the fixture's min_reward, step 1 ends the episode: step 2's agent never ran (the
    # row's validation holds one agent_exit per step run).
    assert rewards("gated") == [("make-file", 0)] and rows["gated"]["reward"] == 0
    # Neither agent nor step 1's tests found a later step's statement or tests, nor step 2's
    # agent step 1's tests.
    assert rewards("no-peek") == [("make-file", 1), ("extend-file", 1)], rows["no-peek"]
    # A reward file the agent planted is gone before the tests; tests that exit 0 without a
    # verdict earn nothing.
    assert rewards("exit-zero") == [("make-file", 0), ("extend-file", 0)]
    assert rows["exit-zero"]["step_rewards"][0]["grade_cause"] == "no_reward_file"
    assert rows["exit-zero"]["reward"] == 0
    print(f"six multi-step episodes on the real node: {seconds:.1f} s")

"""Harbor task keys honoured end to end on the local backend (real Redis, workers and
bubblewrap sandboxes), as a user runs them: `rollout run --tasks DIR --agent oracle
--all-in-one` with no limit flag. A task whose [environment] workdir is not the default gets
its oracle run there (it scored 0 when the key was dropped); a task whose [verifier]
timeout_sec is short has its tests stopped at that limit, not the runner's own 60 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.test_harbor import make_task

pytestmark = [pytest.mark.redis, pytest.mark.workers]

WORKDIR_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(pwd)" = /custom-workdir ] && [ -f /custom-workdir/out.txt ] \\
    && [ -f /custom-workdir/data.txt ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
"""
SLOW_TEST = """#!/bin/bash
mkdir -p /logs/verifier
sleep 40
echo 1 > /logs/verifier/reward.txt
"""


def key_tasks(tasks):
    """A task in a workdir of its own, and one whose tests outlast its verifier's limit."""
    make_task(
        tasks,
        "custom-workdir",
        toml='[agent]\ntimeout_sec = 20\n[environment]\nworkdir = "/custom-workdir"\n',
        environment={"data.txt": "x\n"},
        tests={"test.sh": WORKDIR_TEST},
        solution={"solve.sh": "#!/bin/bash\necho done > out.txt\n"},
    )
    make_task(
        tasks,
        "slow-tests",
        toml="[agent]\ntimeout_sec = 20\n[verifier]\ntimeout_sec = 3\n",
        tests={"test.sh": SLOW_TEST},
        solution={"solve.sh": "#!/bin/bash\ntrue\n"},
    )
    return tasks


def oracle_rewards(tasks, *flags: str) -> tuple[dict, dict]:
    """`rollout run --agent oracle` over `tasks`: each task's rewards, and its group."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", "oracle", "--json", *flags),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    groups = {g["task_id"]: g for g in json.loads(done.stdout)["groups"]}
    return {task: g["rewards"] for task, g in groups.items()}, groups


def test_oracle_runs_in_the_tasks_workdir_and_tests_stop_at_the_verifiers_limit(tmp_path):
    rewards, groups = oracle_rewards(key_tasks(tmp_path / "tasks"), "--all-in-one")
    assert rewards == {"custom-workdir": [1], "slow-tests": [0]}, groups
    # The slow tests were stopped at 3 s: the run did not wait out their 40 s sleep.
    assert 3 <= groups["slow-tests"]["cost"]["wall"]["tests"] < 10


@pytest.mark.k8s
@pytest.mark.k8s_real
def test_the_same_tasks_keep_their_workdir_and_verifier_limit_on_the_real_node(
    tmp_path, real_node, real_stack
):
    rewards, groups = oracle_rewards(
        key_tasks(tmp_path / "tasks"),
        *real_node.run_flags(),
        *("--capacity-check", "warn", "--redis-url", real_stack.redis_url),
    )
    assert rewards == {"custom-workdir": [1], "slow-tests": [0]}, groups
    assert 3 <= groups["slow-tests"]["cost"]["wall"]["tests"] < 10

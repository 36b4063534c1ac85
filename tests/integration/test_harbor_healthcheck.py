"""Harbor's [environment.healthcheck] end to end on the local backend (real Redis, workers and
bubblewrap sandboxes): `rollout run --tasks DIR --agent oracle --all-in-one`. A check that
passes once the environment is ready lets the oracle run and score; one that never passes is
an infrastructure failure of its group (no reward-0 sample), its cause the check's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.test_harbor import make_task

pytestmark = [pytest.mark.redis, pytest.mark.workers]

TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ -f done ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
SOLVE = "#!/bin/bash\n[ -f checked ] && touch done\n"


def test_the_oracle_runs_after_its_check_passes_and_a_check_that_never_does_is_no_sample(
    tmp_path,
):
    tasks = tmp_path / "tasks"
    make_task(
        tasks,
        "ready-later",
        toml="[agent]\ntimeout_sec = 20\n[environment.healthcheck]\n"
        'command = "[ -f checked ] || { touch checked; exit 1; }"\n'
        "interval_sec = 0.1\nretries = 3\n",
        tests={"test.sh": TEST},
        solution={"solve.sh": SOLVE},
    )
    make_task(
        tasks,
        "never-ready",
        toml="[agent]\ntimeout_sec = 20\n[environment.healthcheck]\n"
        'command = "echo service down; exit 7"\ninterval_sec = 0.1\nretries = 2\n',
        tests={"test.sh": TEST},
        solution={"solve.sh": "#!/bin/bash\ntouch done\n"},
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", "oracle", "--json", "--all-in-one"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    groups = {g["task_id"]: g for g in json.loads(done.stdout)["groups"]}
    assert groups["ready-later"]["rewards"] == [1], groups
    never = groups["never-ready"]
    assert never["rewards"] == [] and never["valid_samples"] == 0, never
    (failed,) = never["failed"]
    assert failed["failure_kind"] == "infrastructure", failed
    assert failed["cause"].startswith("the task's healthcheck did not pass: 2 failure(s)"), failed
    assert "last exit status 7: service down" in failed["cause"], failed
    assert done.returncode != 0  # the batch is not ok with a failed episode


# The check appends to /tmp/health-attempts: a fresh grader's /tmp starts empty, so the tests
# find the file only when the check ran in the grader's own sandbox before them.
FRESH_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ -f done ] && [ "$(wc -l < /tmp/health-attempts)" = 1 ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""


def test_a_fresh_grader_runs_the_healthcheck_before_the_tests_and_one_never_ready_is_no_sample(
    tmp_path,
):
    """Harbor runs the verifier in an environment whose healthcheck passed: a `grade: fresh`
    (environment_mode = "separate") grader's sandbox is a new one, so the check runs there too
    before the tests. `graded-when-ready`: its tests see the check's own trace in the grader's
    fresh /tmp (0 when the grader skips the check). `grader-never-ready`: its check passes
    before the agent (no done yet) and never after it, so the grader's environment never gets
    ready: an infrastructure failure naming the check, not a reward (1 when the grader skips
    the check)."""
    tasks = tmp_path / "tasks"
    separate = '[verifier]\ntimeout_sec = 20\nenvironment_mode = "separate"\n'
    make_task(
        tasks,
        "graded-when-ready",
        toml="[agent]\ntimeout_sec = 20\n" + separate + "[environment.healthcheck]\n"
        'command = "echo attempt >> /tmp/health-attempts"\ninterval_sec = 0.1\n',
        tests={"test.sh": FRESH_TEST},
        solution={"solve.sh": "#!/bin/bash\ntouch done\n"},
    )
    make_task(
        tasks,
        "grader-never-ready",
        toml="[agent]\ntimeout_sec = 20\n" + separate + "[environment.healthcheck]\n"
        'command = "[ ! -f done ] || { echo done already; exit 4; }"\n'
        "interval_sec = 0.1\nretries = 2\n",
        tests={"test.sh": TEST},
        solution={"solve.sh": "#!/bin/bash\ntouch done\n"},
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", "oracle", "--json", "--all-in-one"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    groups = {g["task_id"]: g for g in json.loads(done.stdout)["groups"]}
    assert groups["graded-when-ready"]["rewards"] == [1], groups
    never = groups["grader-never-ready"]
    assert never["rewards"] == [] and never["valid_samples"] == 0, never
    (failed,) = never["failed"]
    assert failed["failure_kind"] == "infrastructure", failed
    assert failed["cause"].startswith("the task's healthcheck did not pass: 2 failure(s)"), failed
    assert "last exit status 4: done already" in failed["cause"], failed

"""An episode's disk limit on the local backend, end to end (real Redis, workers and
bubblewrap sandboxes): `rollout run --tasks DIR --agent COMMAND --all-in-one` on Harbor tasks
stating `[environment] storage_mb = 64` (the batch's storage_limit, no flag). An agent that
writes 80 MiB into its workspace is ended by the supervisor's measurement: the row is an
`episode` failure (StorageLimitExceeded), reward 0, listed in its group, never retried
(--infra-retries 1). One that writes 8 MiB is graded as usual (reward 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.unit.test_harbor import make_task

pytestmark = [pytest.mark.redis, pytest.mark.workers]

TOML = "[agent]\ntimeout_sec = 60\n[environment]\nstorage_mb = 64\n"
TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ -f small ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""
# 80 MiB in two files (each under the sandbox's RLIMIT_FSIZE), then it keeps running: the
# supervisor's next measurement ends it. The small one writes 8 MiB and exits.
AGENT = (
    "if [ -f fill ]; then head -c 41943040 /dev/zero > a; head -c 41943040 /dev/zero > b; "
    "sleep 50; else head -c 8388608 /dev/zero > small; fi"
)


def test_an_agent_that_fills_its_disk_fails_its_own_episode_and_is_not_retried(open_tmp_path):
    tasks = open_tmp_path / "tasks"
    make_task(tasks, "fill-disk", toml=TOML, environment={"fill": "x\n"}, tests={"test.sh": TEST})
    make_task(tasks, "small-write", toml=TOML, tests={"test.sh": TEST})
    output = open_tmp_path / "records"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", f"sh -c '{AGENT}'", "--policy-url", "http://127.0.0.1:9"),
            *("--infra-retries", "1", "--json", "--all-in-one", "--output", str(output)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert (output / "results.json").exists(), done.stderr[-3000:]
    report = json.loads((output / "results.json").read_text())
    rows = {r["task_id"]: r for r in report["pods"]}
    groups = {g["task_id"]: g for g in report["groups"]}
    full = rows["fill-disk"]
    assert full["status"] == "failed" and full["reward"] == 0, full
    assert full["failure_kind"] == "episode", full
    assert full["failure_cause"].startswith("sandbox phase is Failed (StorageLimitExceeded: "), full
    assert "over its storage_limit of 67108864 bytes" in full["failure_cause"]
    assert full["retried"] == [] and groups["fill-disk"]["retries"] == 0
    # Ended by the measurement, not by its 50 s sleep or its 60 s limit.
    assert full["finished_at"] - full["created_at"] < 30, full
    # Kept in its group as the agent's failure: the group is incomplete, not failed.
    assert groups["fill-disk"]["status"] == "incomplete"
    (failed,) = groups["fill-disk"]["failed"]
    assert failed["failure_kind"] == "episode"
    small = rows["small-write"]
    assert small["status"] == "ok" and small["reward"] == 1, small

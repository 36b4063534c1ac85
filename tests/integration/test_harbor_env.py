"""Harbor's env tables end to end on the local backend (real Redis, workers and bubblewrap
sandboxes): `rollout run --tasks DIR --agent oracle --all-in-one`. The ${VAR} templates are
resolved from the workers' environment when each sandbox starts; the oracle sees
[environment.env] and [solution.env], the tests [environment.env] and [verifier.env], and no
resolved value reaches the report or the records. A ${VAR} the workers lack refuses the batch
by name before any episode runs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.unit.test_harbor import make_task

pytestmark = [pytest.mark.redis, pytest.mark.workers]

SHOWN = "shown-Zq81-value"  # [environment.env] SHOWN = "${ROLLOUT_TEST_SHOWN}"
JUDGE = "judge-Kx27-value"  # [verifier.env] JUDGE = "${ROLLOUT_TEST_JUDGE}"
TOML = """[agent]
timeout_sec = 20
[environment.env]
SHOWN = "${ROLLOUT_TEST_SHOWN}"
DEFAULTED = "${ROLLOUT_TEST_NEVER_SET:-fallback}"
[verifier.env]
JUDGE = "${ROLLOUT_TEST_JUDGE}"
[solution.env]
HINT = "literal-hint"
"""
# What the oracle saw, as hashes (the values themselves must appear nowhere in the records).
SOLVE = """#!/bin/bash
h() { printf %s "$1" | sha256sum | cut -c1-16; }
{
  echo "SHOWN=$(h "${SHOWN-unset}")"
  echo "DEFAULTED=${DEFAULTED-unset}"
  echo "JUDGE=${JUDGE-unset}"
  echo "HINT=${HINT-unset}"
  grep -c "ROLLOUT_TEST_J""UDGE" /sandbox/tasks.json || true  # split: this script is in it
} > out.txt
"""
TEST = """#!/bin/bash
mkdir -p /logs/verifier
h() { printf %s "$1" | sha256sum | cut -c1-16; }
expected="SHOWN=SHOWN_HASH
DEFAULTED=fallback
JUDGE=unset
HINT=literal-hint
0"
if [ "$(cat out.txt)" = "$expected" ] && [ "$(h "$JUDGE")" = JUDGE_HASH ] \\
    && [ "$(h "$SHOWN")" = SHOWN_HASH ] && [ -z "${HINT-}" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    cat out.txt; echo 0 > /logs/verifier/reward.txt
fi
"""


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def env_task(tasks):
    test = TEST.replace("SHOWN_HASH", _hash(SHOWN)).replace("JUDGE_HASH", _hash(JUDGE))
    make_task(tasks, "env-tables", toml=TOML, tests={"test.sh": test}, solution={"solve.sh": SOLVE})
    return tasks


def run_oracle(tasks, output, env):
    return subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "run", "--tasks", str(tasks)),
            *("--agent", "oracle", "--json", "--all-in-one", "--output", str(output)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_each_process_sees_its_env_tables_and_no_resolved_value_is_recorded(tmp_path):
    env = dict(os.environ, ROLLOUT_TEST_SHOWN=SHOWN, ROLLOUT_TEST_JUDGE=JUDGE)
    env.pop("ROLLOUT_TEST_NEVER_SET", None)
    done = run_oracle(env_task(tmp_path / "tasks"), tmp_path / "records", env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["groups"][0]["rewards"] == [1], report
    for text in (done.stdout, done.stderr):
        assert SHOWN not in text and JUDGE not in text
    files = [p for p in (tmp_path / "records").rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        assert SHOWN.encode() not in data and JUDGE.encode() not in data, path
    # The templates themselves travel as written (the request and the receipt hold them).
    assert b"${ROLLOUT_TEST_JUDGE}" in (tmp_path / "records" / "receipt.json").read_bytes()


def test_a_var_the_workers_lack_refuses_the_batch_naming_it_before_any_episode(tmp_path):
    env = dict(os.environ, ROLLOUT_TEST_SHOWN=SHOWN)
    env.pop("ROLLOUT_TEST_JUDGE", None)
    done = run_oracle(env_task(tmp_path / "tasks"), tmp_path / "records", env)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "task 'env-tables': [verifier.env] JUDGE = ${ROLLOUT_TEST_JUDGE}" in said, said
    assert "ROLLOUT_TEST_JUDGE is not set" in said, said
    report = json.loads(done.stdout)
    assert report["status"] == "error" and not report.get("pods"), report  # no episode ran

"""The two sandboxes of an agent's episode whose tests it must never see: the agent's, then
the grader's (ROLLOUT_PHASE=grade), which gets the tests. `same` grading gives the grader the
agent's /tmp, /logs and workspace as they were left; `fresh` only a copy of the workspace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from rollout_worker.backends.local.sandbox import SANDBOX_GID, SANDBOX_UID, Mount

AGENT_PHASE = "agent"
GRADE_PHASE = "grade"
# The runner's variable for the baseline's counts (sandbox/episode.py BASELINE_TESTS_ENV).
BASELINE_TESTS_ENV = "ROLLOUT_BASELINE_TESTS"
# What the runner reads and writes outside its workspace (writable, per episode): folder ->
# (where the sandbox sees it, the variable naming it when not sandboxed); and its /tmp.
STATE_DIRS = {
    "logs": ("/logs", ""),
    "logs/verifier": ("/logs/verifier", "ROLLOUT_VERIFIER_DIR"),
    "tests": ("/tests", "ROLLOUT_TESTS_DIR"),
    "solution": ("/solution", "ROLLOUT_SOLUTION_DIR"),
    "tmp": ("", ""),
}


def baseline_tests(line: bytes) -> str:
    """The `baseline_tests` of a grade_pending line, as JSON ("null" when it has none)."""
    try:
        value = orjson.loads(line).get("baseline_tests")
    except (orjson.JSONDecodeError, AttributeError):
        return "null"
    return orjson.dumps(value).decode() if isinstance(value, dict) else "null"


def phase_env(task: dict[str, Any], phase: str, baseline: str | None) -> dict[str, str]:
    """What tells the runner which sandbox it is in: the grader's (with the agent's
    `baseline` counts), or an agent's whose tests come with a grader's sandbox."""
    if phase == GRADE_PHASE:
        # What the agent's sandbox counted before its agent acted: the grader holds the
        # tests to it (fewer tests run is no pass).
        return {"ROLLOUT_PHASE": GRADE_PHASE, BASELINE_TESTS_ENV: baseline or "null"}
    if "tests" in task:
        return {"ROLLOUT_GRADER": "sandbox"}  # its tests come with the grader's sandbox
    return {}


def state_phase(task: dict[str, Any], phase: str) -> str:
    """Whose /tmp and /logs a sandbox gets: grading `same` finds the agent's as they were
    left; `fresh` its own."""
    return GRADE_PHASE if phase == GRADE_PHASE and task.get("grade") == "fresh" else AGENT_PHASE


def state_mounts(state: Path, as_root: bool) -> list[Mount]:
    """The episode's state folders (made here, the sandbox's user's when run as root),
    mounted writable where the runner looks for them."""
    mounts = []
    for name, (target, env_name) in STATE_DIRS.items():
        (state / name).mkdir(parents=True, exist_ok=True)
        if as_root:
            os.chown(state / name, SANDBOX_UID, SANDBOX_GID)
        if target:
            mounts.append(Mount(state / name, target, env_name, writable=True))
    return mounts

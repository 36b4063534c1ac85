"""The two sandboxes of an agent's episode whose tests it must never see: the agent's, then
the grader's (ROLLOUT_PHASE=grade), which gets the tests. `same` grading gives the grader the
agent's /tmp, /logs and workspace as they were left; `fresh` only a copy of the workspace."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from rollout_wire.task_spec import TASK_ENV_PREFIX, env_tables_for, env_templates
from rollout_wire.task_steps import agent_steps
from rollout_wire.tasksets import agent_task as shared_agent_task
from rollout_worker.backends.local.sandbox import (
    SANDBOX_GID,
    SANDBOX_UID,
    Mount,
    SandboxPlan,
    secret_args,
)

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


def phase_env(task: Mapping[str, Any], phase: str, baseline: str | None) -> dict[str, str]:
    """What tells the runner which sandbox it is in: the grader's (with the agent's
    `baseline` counts), or an agent's whose tests come with a grader's sandbox."""
    if phase == GRADE_PHASE:
        # What the agent's sandbox counted before its agent acted: the grader holds the
        # tests to it (fewer tests run is no pass).
        return {"ROLLOUT_PHASE": GRADE_PHASE, BASELINE_TESTS_ENV: baseline or "null"}
    if "tests" in task:
        return {"ROLLOUT_GRADER": "sandbox"}  # its tests come with the grader's sandbox
    return {}


def two_sandboxes(task: Mapping[str, Any]) -> bool:
    """Whether an episode gets its own /tests, /logs and /solution and may grade in a second
    sandbox: any agent (the built-in loop too) of a task with hidden tests, `grade: fresh` or
    steps, and any agent command or oracle. Only a built-in loop over visible test files
    (the bundled tasks, the demo) grades in place without them."""
    return (
        "agent" in task
        or "steps" in task
        or bool(task.get("tests"))
        or task.get("grade") == "fresh"
    )


def state_phase(task: Mapping[str, Any], phase: str) -> str:
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


def env_tables(task: Mapping[str, Any], phase: str) -> set[str]:
    """The task's env tables a sandbox of `phase` needs (task_spec.env_tables_for)."""
    return env_tables_for(task, grading=phase == GRADE_PHASE)


def agent_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """The task as its agent's sandbox holds it (tasksets.agent_task, shared with Kubernetes);
    of its steps, only their names and limits (the rest comes apart: hidden_steps_mount)."""
    view = shared_agent_task(task)
    if task.get("steps"):
        view["steps"] = agent_steps(task["steps"])
    return view


# Where a task's steps wait for the runner (runner/task.py HIDDEN_STEPS_ENV, HIDDEN_STEPS_FILE).
HIDDEN_STEPS_ENV = "ROLLOUT_HIDDEN_STEPS_DIR"
HIDDEN_STEPS_FILE = "steps.json"


def hidden_steps_mount(task: Mapping[str, Any], state: Path, as_root: bool) -> list[Mount]:
    """A task with steps: its steps in full, in a folder of the agent's sandbox that its runner
    empties before any agent process exists (the agent's tasks file has their names only)."""
    if not task.get("steps"):
        return []
    folder = state / "steps"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / HIDDEN_STEPS_FILE
    path.write_bytes(orjson.dumps({task["id"]: task["steps"]}))
    if as_root:
        os.chown(folder, SANDBOX_UID, SANDBOX_GID)
        os.chown(path, SANDBOX_UID, SANDBOX_GID)
    return [Mount(folder, "/sandbox/steps", HIDDEN_STEPS_ENV, writable=True)]


def task_env_values(
    task: Mapping[str, Any], phase: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """The host's values of the task's ${VAR} templates this sandbox's tables use, under the
    runner's names (TASK_ENV_PREFIX + VAR); a VAR `environ` lacks is left to its default
    (the backend refused the batch when one had none)."""
    wanted = env_tables(task, phase)
    return {
        TASK_ENV_PREFIX + var: environ[var]
        for table, _, var, _ in env_templates(task)
        if table in wanted and var in environ
    }


def secret_fd(plan: SandboxPlan) -> int | None:
    """A memory file holding the plan's secret variables as bwrap's --args (None when it has
    none, or runs without bwrap: then they are in its env). The caller closes it."""
    if not plan.secret_env or plan.argv[0] != "bwrap":
        return None
    fd = os.memfd_create("rollout-task-env", os.MFD_CLOEXEC)
    os.write(fd, secret_args(plan.secret_env))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd

"""A multi-step Harbor task (`[[steps]]`, a `steps/` folder) as the task's `steps`
(`rollout_wire.task_steps`). Harbor's layout:

    task.toml           multi_step_reward_strategy ("mean", its default, or "final");
                        [[steps]] name, min_reward, [steps.agent], [steps.verifier], ...
    instruction.md      optional (never the agent's: each step has its own)
    environment/        the one environment every step shares
    tests/              optional: shared helpers (and a fallback test.sh) under each step's
    steps/<name>/       instruction.md (required), tests/ (over the task's tests/: same
                        names win), solution/ (the oracle's, solve.sh)

Each [[steps]] key, honoured or refused by name:

  name                          the step's name; steps/<name>/ its folder
  min_reward (a number)         `min_reward`: below it the episode ends, later steps not run
  min_reward (a table of keys)  refused (gating on several reward keys)
  [steps.agent] timeout_sec     the step's `time_limit_seconds` (else [agent] timeout_sec)
  [steps.verifier] timeout_sec  the step's `test_timeout_seconds` (else [verifier]'s)
  [steps.agent|verifier] user, network_mode, allowed_hosts
                                as the task-wide keys: 1000 / no network honoured, else refused
  [steps.verifier] environment_mode
                                "shared" honoured; "separate" refused (steps share a sandbox)
  [steps.verifier] env, environment, [steps.healthcheck], artifacts
                                refused (not per step here)
  steps/<name>/workdir/         refused (per-step set-up files and hooks)

The task's time_limit_seconds and test_timeout_seconds become the sums of its steps' (the
episode's budget); each step keeps its own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rollout_wire.harbor_files import (
    INSTRUCTION,
    TEST_SCRIPT,
    has_folder,
    is_kind,
    kind_of,
    read_text,
    read_tree,
)
from rollout_wire.task_spec import DEFAULT_TEST_TIMEOUT_SECONDS
from rollout_wire.task_steps import MAX_TASK_STEPS, STEP_NAME, STEP_REWARD_STRATEGIES

STEP_KEYS = frozenset({"name", "agent", "verifier", "min_reward", "healthcheck", "artifacts"})
_PHASE_KEYS = {
    "agent": frozenset({"timeout_sec", "user", "network_mode", "allowed_hosts"}),
    "verifier": frozenset(
        {"timeout_sec", "user", "network_mode", "allowed_hosts", "environment_mode"}
    ),
}
_REFUSED = {
    "verifier.env": "a step's own [verifier.env] is not supported (the task's applies)",
    "verifier.environment": "a separate verifier environment is not supported",
    "healthcheck": "a step's healthcheck is not supported (the task's runs once, first)",
    "artifacts": "a step's artifacts are not supported (the task's are read at the end)",
}


def map_steps(
    task: dict[str, Any], folder: Path, config: dict[str, Any], where: str, problems: list[str]
) -> None:
    """The task's `steps` from [[steps]] and steps/<name>/, or problems naming each key or
    file refused. `task` already holds the task-wide limits (the steps' defaults)."""
    steps = config.get("steps")
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_TASK_STEPS:
        problems.append(f"{where}: [[steps]] must be 1..{MAX_TASK_STEPS} tables")
        return
    strategy = config.get("multi_step_reward_strategy", "mean")
    if strategy not in STEP_REWARD_STRATEGIES:
        problems.append(
            f"{where}: multi_step_reward_strategy {strategy!r} is not one of "
            f"{list(STEP_REWARD_STRATEGIES)}"
        )
    if kind_of(folder / "solution") != "missing":
        problems.append(f"{where}: solution/ of a task with steps: each step has its own")
    shared: dict[str, str] = {}
    if has_folder(folder / "tests", "tests", where, problems):
        shared = read_tree(folder / "tests", where, problems)
    mapped = []
    for position, step in enumerate(steps):
        label = f"{where}: [[steps]] {position + 1}"
        if not isinstance(step, dict):
            problems.append(f"{label} must be a table")
            continue
        one = _map_step(task, folder, step, shared, label, problems)
        if one is not None:
            mapped.append(one)
    if len(mapped) != len(steps):
        return
    names = [s["name"] for s in mapped]
    if len(set(names)) != len(names):
        problems.append(f"{where}: [[steps]] names {names} repeat")
    task["steps"] = mapped
    task["step_reward_strategy"] = strategy
    # The episode's budget: every step's agent, then every step's tests.
    task["time_limit_seconds"] = sum(s["time_limit_seconds"] for s in mapped)
    task["test_timeout_seconds"] = sum(s["test_timeout_seconds"] for s in mapped)
    task.pop("tests", None)
    task.pop("solution", None)


def _map_step(
    task: dict[str, Any],
    folder: Path,
    step: dict[str, Any],
    shared: dict[str, str],
    label: str,
    problems: list[str],
) -> dict[str, Any] | None:
    before = len(problems)
    name = step.get("name")
    if not isinstance(name, str) or not STEP_NAME.match(name):
        problems.append(f"{label}: name {name!r} must be a folder name of steps/")
        return None
    label = f"{label} ({name})"
    _step_keys(step, label, problems)
    one: dict[str, Any] = {"name": name}
    bound = step.get("min_reward")
    if isinstance(bound, dict):
        problems.append(f"{label}: min_reward as a table of reward keys is not supported")
    elif bound is not None:
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            problems.append(f"{label}: min_reward must be a number")
        else:
            one["min_reward"] = bound
    agent, verifier = step.get("agent") or {}, step.get("verifier") or {}
    one["time_limit_seconds"] = _seconds(
        agent.get("timeout_sec"), task["time_limit_seconds"], f"{label}: [steps.agent]", problems
    )
    one["test_timeout_seconds"] = _seconds(
        verifier.get("timeout_sec"),
        task.get("test_timeout_seconds", DEFAULT_TEST_TIMEOUT_SECONDS),
        f"{label}: [steps.verifier]",
        problems,
    )
    _step_folder(one, folder / "steps" / name, shared, label, problems)
    return one if len(problems) == before else None


def _step_keys(step: dict[str, Any], label: str, problems: list[str]) -> None:
    """Every key of the step known, and each refused one named."""
    for key in sorted(set(step) - STEP_KEYS):
        problems.append(f"{label}: unknown key {key!r}")
    for key in ("healthcheck", "artifacts"):
        if step.get(key):
            problems.append(f"{label}: {key}: {_REFUSED[key]}")
    for phase, known in _PHASE_KEYS.items():
        table = step.get(phase)
        if table is None:
            continue
        if not isinstance(table, dict):
            problems.append(f"{label}: [steps.{phase}] must be a table")
            continue
        for key in sorted(set(table) - known):
            why = _REFUSED.get(f"{phase}.{key}", "unknown key")
            if why != "unknown key" and not table[key]:
                continue  # an empty table asks for nothing
            problems.append(f"{label}: [steps.{phase}] {key}: {why}")
        user = table.get("user")
        if user is not None and (isinstance(user, bool) or user not in ("1000", 1000)):
            problems.append(f"{label}: [steps.{phase}] user = {user!r}: the sandbox runs as 1000")
        network = table.get("network_mode")
        if network is not None and network not in ("no-network", "none"):
            problems.append(f"{label}: [steps.{phase}] network_mode {network!r}: no network")
        if table.get("allowed_hosts"):
            problems.append(f"{label}: [steps.{phase}] allowed_hosts: sandboxes have no network")
        mode = table.get("environment_mode")
        if mode is not None and mode != "shared":
            problems.append(
                f"{label}: [steps.verifier] environment_mode {mode!r}: steps share one sandbox"
            )


def _step_folder(
    one: dict[str, Any], path: Path, shared: dict[str, str], label: str, problems: list[str]
) -> None:
    """steps/<name>/: its instruction, its tests over the task's, its solution."""
    if not is_kind(path, f"steps/{path.name}", "dir", label, problems):
        return
    if kind_of(path / "workdir") != "missing":
        problems.append(f"{label}: steps/{path.name}/workdir/ (per-step set-up) is not supported")
    instruction = path / INSTRUCTION
    if is_kind(instruction, f"steps/{path.name}/{INSTRUCTION}", "file", label, problems):
        text = read_text(instruction, label, problems) or ""
        if not text.strip():
            problems.append(f"{label}: steps/{path.name}/{INSTRUCTION} is empty")
        one["statement"] = text
    tests = dict(shared)
    if has_folder(path / "tests", f"steps/{path.name}/tests", label, problems):
        tests |= read_tree(path / "tests", label, problems)
    if TEST_SCRIPT not in tests:
        problems.append(f"{label}: no {TEST_SCRIPT} in steps/{path.name}/tests/ or tests/")
    one["tests"] = tests
    if has_folder(path / "solution", f"steps/{path.name}/solution", label, problems):
        one["solution"] = read_tree(path / "solution", label, problems)


def _seconds(value: Any, default: int, label: str, problems: list[str]) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        problems.append(f"{label} timeout_sec must be a positive number, got {value!r}")
        return default
    return math.ceil(value)

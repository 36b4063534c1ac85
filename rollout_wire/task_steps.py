"""A multi-step task (`steps`, Harbor's [[steps]]): its steps checked as hostile input, how
their rewards make the episode's (Harbor's multi_step_reward_strategy), and what a backend
that cannot run them refuses.

A step is {name, statement, tests, solution?, min_reward?, time_limit_seconds?,
test_timeout_seconds?}. The runner runs the steps in order in the episode's one sandbox (on
Kubernetes, in the Pod's containers one after the other): the step's agent on its statement,
then its tests (placed only then, graded as a task's are); a step whose reward is below its
`min_reward` ends the episode, the later steps not run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

MAX_TASK_STEPS = 20
MAX_STEP_SECONDS = 7 * 24 * 3600
# Harbor's strategies: `mean` (its default) the mean of the steps that ran (a step gated off
# has no verifier result and is left out, as Harbor leaves it out); `final` the last run step's.
STEP_REWARD_STRATEGIES = ("mean", "final")
STEP_FIELDS = frozenset(
    {
        "name",
        "statement",
        "tests",
        "solution",
        "min_reward",
        "time_limit_seconds",
        "test_timeout_seconds",
    }
)
# A step name is a folder name (Harbor's steps/<name>/).
STEP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_FILE_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")
_SOLVE_SCRIPT = "solve.sh"


def combine_step_rewards(strategy: str, rewards: Sequence[float]) -> float:
    """The episode's reward from the rewards of the steps that ran, in order."""
    if not rewards:
        return 0.0
    if strategy == "final":
        return float(rewards[-1])
    return float(sum(rewards) / len(rewards))


def _files_problem(value: Any) -> str | None:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        return "must map relative paths to text"
    for path in value:
        if not isinstance(path, str) or len(path) > 200 or not _FILE_PATH.match(path):
            return f"path {path!r} must be relative, without '..'"
    return None


def _check_step(step: Any, where: str, names: set[str], problems: list[str]) -> None:
    if not isinstance(step, Mapping):
        problems.append(f"{where} must be an object")
        return
    unknown = sorted(set(step) - STEP_FIELDS)
    if unknown:
        problems.append(f"{where}: unknown fields {unknown}; allowed: {sorted(STEP_FIELDS)}")
    name = step.get("name")
    if not isinstance(name, str) or not STEP_NAME.match(name):
        problems.append(f"{where}: name {name!r} must be 1-63 letters, digits, '_', '.', '-'")
    elif name in names:
        problems.append(f"{where}: name {name!r} appears twice")
    else:
        names.add(name)
    statement = step.get("statement")
    if not isinstance(statement, str) or not statement.strip():
        problems.append(f"{where}: statement must be non-empty text")
    for field in ("tests", "solution"):
        if field in step or field == "tests":
            why = _files_problem(step.get(field))
            if why is None and field == "tests" and not step.get(field):
                why = "must hold the step's tests"
            if why is not None:
                problems.append(f"{where}: {field} {why}")
    bound = step.get("min_reward")
    if bound is not None and (
        isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound)
    ):
        problems.append(f"{where}: min_reward {bound!r} must be a finite number")
    for field in ("time_limit_seconds", "test_timeout_seconds"):
        number = step.get(field)
        if number is not None and (
            isinstance(number, bool)
            or not isinstance(number, int)
            or not 1 <= number <= MAX_STEP_SECONDS
        ):
            problems.append(f"{where}: {field} must be an integer within 1..{MAX_STEP_SECONDS}")


def check_steps(task: Mapping[str, Any], problems: list[str]) -> None:
    """A task's `steps` and `step_reward_strategy`, and what cannot go with them."""
    tid = task.get("id")
    if "steps" not in task:
        if "step_reward_strategy" in task:
            problems.append(f"task {tid!r}: step_reward_strategy needs steps")
        return
    steps = task["steps"]
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_TASK_STEPS:
        problems.append(f"task {tid!r}: steps must be a list of 1..{MAX_TASK_STEPS} steps")
        return
    names: set[str] = set()
    for position, step in enumerate(steps):
        _check_step(step, f"task {tid!r}: steps[{position}]", names, problems)
    strategy = task.get("step_reward_strategy", "mean")
    if strategy not in STEP_REWARD_STRATEGIES:
        problems.append(
            f"task {tid!r}: step_reward_strategy {strategy!r} is not one of "
            f"{list(STEP_REWARD_STRATEGIES)}"
        )
    # Each step holds its own tests and solution; the task-wide ones would be a second set.
    for field in ("tests", "solution"):
        if field in task:
            problems.append(f"task {tid!r}: {field} goes in each step of a task with steps")
    if task.get("grade", "same") == "fresh":
        problems.append(
            f"task {tid!r}: grade: fresh cannot go with steps: every step's agent continues "
            "in the sandbox the previous step's tests ran in"
        )
    if task.get("baseline", True):
        problems.append(f"task {tid!r}: a task with steps needs baseline: false")


def oracle_step_problems(task: Mapping[str, Any]) -> list[str]:
    """The oracle runs each step's solution: each needs its solve.sh."""
    steps = task.get("steps")
    if not isinstance(steps, list):
        return []
    return [
        f"task {task.get('id')!r}: the oracle agent needs solution/{_SOLVE_SCRIPT} in step "
        f"{step.get('name')!r}"
        for step in steps
        if isinstance(step, Mapping) and _SOLVE_SCRIPT not in (step.get("solution") or {})
    ]


def agent_steps(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What an agent's sandbox may hold of its steps: their names and limits. Their statements,
    tests and solutions reach the runner apart (a later step's are no earlier step's to read)."""
    return [
        {key: value for key, value in step.items() if key in ("name", "min_reward")}
        for step in steps
    ]


def kubernetes_step_problems(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    """Tasks with steps on Kubernetes: their Pod runs each step's agent and each step's tests
    in containers of their own, in order, over the Pod's workspace volume (kube pod_steps.py).
    A task in its own image (an environment/Dockerfile, docker_image) is refused: it works in
    its image's own folders, which a container does not share with the next."""
    own = [str(t.get("id")) for t in tasks if t.get("steps") and t.get("image")]
    if not own:
        return []
    return [
        f"tasks with steps (Harbor [[steps]]) in their own image (environment/Dockerfile or "
        f"docker_image) run on the local backend only: on Kubernetes each step runs in "
        f"containers of its own, which share a workspace volume, not the image's folders: "
        f"{own[:3]}"
    ]

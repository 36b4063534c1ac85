"""Task sets: tasks are data. Resolved at the edge (CLI, trainer client) into the request.

A task set is a JSON file `{"name": ..., "tasks": [task, ...]}` (or a bare list of tasks), or a
folder of Harbor tasks (`rollout_wire.harbor`, mapped to tasks here); the task fields are
described by `rollout_wire.request.TASK_FIELDS` and checked by `parse_spec`.
`bundled` names the set shipped with the package (9 small Python repositories with different
bugs, one of them needing several steps); it is what the tests and the demo use.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, cast

import orjson

from rollout_wire.errors import InvalidSpec, TaskWarning
from rollout_wire.task_spec import (
    MAX_TASK_WARNING_CHARS,
    MAX_TASK_WARNINGS,
    Task,
    env_tables_for,
)

BUNDLED = "bundled"
_BUNDLED_FILE = "data/bundled-tasks.json"


def _tasks_of(value: Any, where: str) -> list[dict[str, Any]]:
    tasks = value.get("tasks") if isinstance(value, dict) else value
    if not isinstance(tasks, list) or not all(isinstance(t, dict) for t in tasks):
        raise InvalidSpec([f"{where}: a task set is a list of tasks or {{'tasks': [...]}}"])
    return tasks


def bundled_tasks() -> list[dict[str, Any]]:
    raw = resources.files("rollout_wire").joinpath(_BUNDLED_FILE).read_bytes()
    return _tasks_of(orjson.loads(raw), BUNDLED)


def demo_task() -> Task:
    """The guide's demo as a task (what a policy sees when a batch has a policy but no tasks):
    the bundled shipping task under the demo's id."""
    from rollout_wire.request import DEMO_TASK_ID

    task = next(t for t in bundled_tasks() if t["id"] == "shipping-boundary")
    return cast(Task, dict(task, id=DEMO_TASK_ID))


def agent_view(task: Mapping[str, Any]) -> dict[str, Any]:
    """What an agent's sandbox may hold of its task: not the tests it is graded by, and the
    solution only when the agent is the oracle (every backend hands the agent this part)."""
    hidden = {"tests"} | (set() if task.get("agent") == "oracle" else {"solution"})
    view = {name: value for name, value in task.items() if name not in hidden}
    if task.get("tests"):
        # Its tests come only after the agent: the runner that holds this view has none to
        # run first, and a baseline of no tests passes (every episode failed so on hosts).
        view["baseline"] = False
    return view


def agent_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """The task as its agent's sandbox or container holds it on every backend (agent_view),
    without the env tables its runner does not hand the agent (env_tables_for): their text,
    literals included, is not the agent's to read."""
    view = agent_view(task)
    env = view.get("env")
    if not env:
        return view
    wanted = env_tables_for(task, grading=False)
    kept = {table: value for table, value in env.items() if table in wanted}
    view = {name: value for name, value in view.items() if name != "env"}
    return view | {"env": kept} if kept else view


def load_task_set(
    ref: str, only: list[str] | None = None, allow_unknown_keys: bool = False
) -> list[dict[str, Any]]:
    """The tasks of `ref`: "bundled", a JSON file or a Harbor task folder. `only` keeps these
    task ids, in order; `allow_unknown_keys`: a Harbor task.toml key this project does not
    know is let through (harbor.scan lists it as a warning) instead of refused."""
    if ref == BUNDLED:
        tasks = bundled_tasks()
    elif Path(ref).is_dir():
        from rollout_wire import harbor

        if not harbor.is_harbor_folder(ref):
            raise InvalidSpec(
                [
                    f"task set {ref!r} is a folder without a Harbor task (no task.toml in it or a "
                    "subfolder)"
                ]
            )
        # Only the tasks asked for are read: a broken task elsewhere does not block them.
        tasks = harbor.load_harbor_tasks(ref, only or None, allow_unknown_keys)
    else:
        path = Path(ref)
        try:
            value = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise InvalidSpec([f"task set {ref!r}: no such file (or use {BUNDLED!r})"]) from None
        except orjson.JSONDecodeError as exc:
            raise InvalidSpec([f"task set {ref!r} is not JSON: {exc}"]) from None
        tasks = _tasks_of(value, ref)
    if only:
        by_id = {t.get("id"): t for t in tasks}
        missing = [name for name in only if name not in by_id]
        if missing:
            raise InvalidSpec([f"task set {ref!r} has no task(s) {missing}"])
        tasks = [by_id[name] for name in only]
    return tasks


def parse_sampling(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """KEY=VALUE pairs (VALUE as JSON when it parses, else text) -> sampling parameters."""
    sampling: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"sampling parameter {item!r} must look like KEY=VALUE")
            continue
        try:
            sampling[key] = orjson.loads(text)
        except orjson.JSONDecodeError:
            sampling[key] = text
    if problems:
        raise InvalidSpec(problems)
    return sampling


def rollout_fields(
    *,
    tasks: str | None,
    only: list[str] | tuple[str, ...] = (),
    samples: int | None,
    policy_url: str | None,
    model: str | None = None,
    sampling: dict[str, Any] | None = None,
    policy_timeout: float | None = None,
    infra_retries: int | None = None,
    groups_wanted: int | None = None,
    group_filter: str | None = None,
    allow_unknown_keys: bool = False,
) -> dict[str, Any]:
    """The request fields of a real rollout from command-line style options (both CLIs):
    tasks resolved to data here, at the edge; `parse_spec` checks the rest."""
    fields: dict[str, Any] = {}
    if tasks is not None:
        # Each warning loading raises (a key let through, one not enforced) rides with the
        # request into the report, and is raised again here for the caller.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TaskWarning)
            fields["tasks"] = load_task_set(tasks, list(only) or None, allow_unknown_keys)
        said = [str(w.message) for w in caught if issubclass(w.category, TaskWarning)]
        for message in said:
            warnings.warn(message, TaskWarning, stacklevel=2)
        if said:
            fields["task_warnings"] = [m[:MAX_TASK_WARNING_CHARS] for m in said[:MAX_TASK_WARNINGS]]
    elif only:
        raise InvalidSpec(["--task needs --tasks (the task set to pick from)"])
    if samples is not None:
        fields["samples_per_task"] = samples
    if policy_url is not None:
        policy: dict[str, Any] = {"url": policy_url, "sampling": dict(sampling or {})}
        if model:
            policy["model"] = model
        if policy_timeout is not None:
            policy["request_timeout_seconds"] = policy_timeout
        fields["policy"] = policy
    elif sampling or model:
        raise InvalidSpec(["--model and --sampling need --policy-url"])
    if infra_retries is not None:
        fields["infra_retries"] = infra_retries
    if groups_wanted is not None:
        fields["groups_wanted"] = groups_wanted
    if group_filter is not None:
        fields["group_filter"] = group_filter
    return fields


# What an episode needs besides its agent's and its tests' time: the sandbox's start, the
# task's files, the baseline run, the grader's own start (a second sandbox for `fresh`).
SETUP_MARGIN_SECONDS = 60
# What a batch needs besides its episodes: queueing, the last records, the report.
DEADLINE_MARGIN_SECONDS = 120


def episode_seconds(task: Mapping[str, Any]) -> int:
    """The longest a task's episode can take: its agent's limit, its tests' limit (twice when
    a baseline run comes first), and the set-up margin."""
    from rollout_wire.request import DEFAULT_TASK_TIME_LIMIT_SECONDS, DEFAULT_TEST_TIMEOUT_SECONDS

    agent = task.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS)
    tests = task.get("test_timeout_seconds", DEFAULT_TEST_TIMEOUT_SECONDS)
    agent = agent if isinstance(agent, int) and not isinstance(agent, bool) else 0
    tests = tests if isinstance(tests, int) and not isinstance(tests, bool) else 0
    runs = 2 if task.get("baseline", True) and not task.get("tests") else 1
    return agent + runs * tests + SETUP_MARGIN_SECONDS


def task_limits(
    tasks: list[Mapping[str, Any]],
    episodes: int,
    parallelism: int | None,
    *,
    episode_timeout: int | None,
    deadline: int | None,
) -> tuple[int, int]:
    """(episode timeout, batch deadline) for a batch of `tasks`: what the user set, else what
    the tasks state (their slowest episode), and the deadline what `episodes` need in waves of
    `parallelism` (None: all at once). Never below the fixed defaults; the deadline at most
    MAX_DEADLINE_SECONDS (parse_spec then refuses an episode timeout above it, by name)."""
    from rollout_wire.request import (
        DEFAULT_DEADLINE_SECONDS,
        DEFAULT_EPISODE_TIMEOUT_SECONDS,
        MAX_DEADLINE_SECONDS,
    )

    if episode_timeout is None:
        slowest = max((episode_seconds(t) for t in tasks), default=0)
        episode_timeout = max(DEFAULT_EPISODE_TIMEOUT_SECONDS, slowest)
    if deadline is None:
        waves = -(-max(episodes, 1) // max(parallelism or episodes, 1))
        needed = waves * episode_timeout + DEADLINE_MARGIN_SECONDS
        deadline = min(MAX_DEADLINE_SECONDS, max(DEFAULT_DEADLINE_SECONDS, needed))
    return episode_timeout, deadline

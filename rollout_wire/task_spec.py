"""A task of a batch request (`rollout_wire.request`): its fields, and the checks each task
passes before a batch is accepted. Tasks are data (resolved at the client's edge, e.g. from
Harbor folders: `rollout_wire.harbor`); every problem of every task is listed at once."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Required, TypedDict, cast

import orjson

from rollout_wire.task_steps import check_steps, oracle_step_problems

MAX_DEADLINE_SECONDS = 7 * 24 * 3600
# A container image reference: [registry[:port]/]path[:tag][@digest], lower-case path parts.
IMAGE_REFERENCE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)

# A batch's tasks travel in the request, the receipt and (on Kubernetes) the batch's ConfigMap,
# whose whole object the API server caps at 1 MiB: the encoded tasks must stay below this.
MAX_TASKS_BYTES = 900 * 1024
MAX_TASKS = 1000
# The warnings loading a task set raised (keys let through, keys not enforced), carried in a
# request for its report: at most this many, each cut to MAX_TASK_WARNING_CHARS.
MAX_TASK_WARNINGS = 200
MAX_TASK_WARNING_CHARS = 1000
DEFAULT_TASK_TIME_LIMIT_SECONDS = 60
DEFAULT_MAX_STEPS = 10
MAX_STEPS = 200
REWARD_RULES = ("all", "fraction", "file")
# Where a `file` reward is read from, in this order (Harbor's verifier reads the JSON first):
# JSON with a numeric `reward` (its other numbers are kept as the row's details), or a number.
REWARD_FILES = ("/logs/verifier/reward.json", "/logs/verifier/reward.txt")
GRADES = ("same", "fresh")
ORACLE = "oracle"
# What the oracle agent runs, from the task's `solution` (Harbor's solution/solve.sh).
SOLVE_SCRIPT = "solve.sh"
# The agent's environment the runner sets itself (an agent's `env` may not override them).
AGENT_RESERVED_ENV = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "OPENAI_MODEL")
MAX_AGENT_ARGS = 64
TASK_FIELDS = {
    "id": "lower-case name, unique in the batch",
    "statement": "the problem shown to the policy",
    "files": "path -> text: the repository the episode starts from",
    "test_files": "path -> text: written again just before the final tests (not editable)",
    "test_command": "argv list; 'python' means the sandbox's interpreter",
    "reward": "all (1 when every test passes, else 0) | fraction (passed / total) | file "
    "(what the tests wrote to /logs/verifier/reward.txt or reward.json)",
    "agent": "the agent to run instead of the built-in loop: {command: argv, env: {name: "
    "value}}, or 'oracle' (runs the task's solution/solve.sh)",
    "baseline": "true (default): the tests must fail before the agent acts; false: no check",
    "tests": "path -> text: placed at /tests only after the agent finished (it never sees them)",
    "solution": "path -> text: placed at /solution for the oracle agent only",
    "grade": "same (default): the tests run where the agent ran; fresh: in a new sandbox that "
    "receives only the workspace the agent left",
    "time_limit_seconds": "the agent loop's time limit",
    "test_timeout_seconds": "the test command's own time limit (default 60)",
    "workdir": "absolute path: where the agent and the tests run (default: the backend's "
    "workspace, /workspace or the image's WORKDIR)",
    "max_steps": "the agent loop's step limit",
    "artifacts": "paths (absolute, or relative to the workspace) read from the sandbox after "
    "the tests into the reward event (the episode's log): each file's path, bytes, sha256 and "
    "text or base64, bounded, never through a link; what is refused listed with why",
    "healthcheck": "{command, interval_seconds, timeout_seconds, start_period_seconds, "
    "start_interval_seconds, retries}: run (sh -c) in the sandbox before the agent, until it "
    "exits 0; `retries` failures in a row (outside the start period) fail the episode as "
    "infrastructure, never a reward",
    "env": "{environment|verifier|solution: {NAME: text}}: Harbor's env tables; a value is text "
    "or a template ${VAR} / ${VAR:-default} resolved where the sandbox starts (the worker's "
    "environment, or the Kubernetes Secret `task_env_secret`), never before: the agent sees "
    "environment's, the tests environment's and verifier's, the oracle environment's and "
    "solution's",
    "steps": "[{name, statement, tests, solution?, min_reward?, time_limit_seconds?, "
    "test_timeout_seconds?}] (1..20): Harbor's [[steps]], run in order in one sandbox (local "
    "backend): each step's agent on its statement, then its tests (placed only then); a step "
    "below its min_reward ends the episode; each step's reward kept on the row (step_rewards); "
    "the task's time_limit_seconds and test_timeout_seconds are the steps' shared budget",
    "step_reward_strategy": "mean (default: the mean of the steps that ran) | final (the last "
    "run step's): Harbor's multi_step_reward_strategy",
    "image": "the image the task needs (kubernetes)",
    "description": "free text for people (not shown to the policy)",
}


class Task(TypedDict, total=False):
    """A task as the request carries it (TASK_FIELDS says what each field means). Typed for
    the code that reads tasks; on the wire it stays the JSON object it always was."""

    id: Required[str]
    statement: Required[str]
    files: Required[dict[str, str]]
    test_command: Required[list[str]]
    test_files: dict[str, str]
    reward: str
    agent: str | dict[str, Any]
    baseline: bool
    tests: dict[str, str]
    solution: dict[str, str]
    grade: str
    time_limit_seconds: int
    test_timeout_seconds: int
    workdir: str
    max_steps: int
    artifacts: list[Any]
    healthcheck: dict[str, Any]
    env: dict[str, dict[str, str]]
    steps: list[dict[str, Any]]
    step_reward_strategy: str
    image: str
    description: str


# The runner's own test time limit (episode.py TESTS_TIMEOUT_SECONDS) when a task sets none.
DEFAULT_TEST_TIMEOUT_SECONDS = 60
_WORKDIR = re.compile(r"^/[A-Za-z0-9_.-]{1,100}(/[A-Za-z0-9_.-]{1,100}){0,15}$")
# Folders the sandbox itself mounts: a workspace there would hide or be hidden by them.
_RESERVED_DIRS = frozenset({"proc", "dev", "sys", "sandbox", "tmp", "logs", "tests", "solution"})
_TASK_ID = re.compile(r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$")
_FILE_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")


def _parse_files(task_id: object, name: str, files: Any, problems: list[str]) -> None:
    if not isinstance(files, Mapping) or not all(isinstance(v, str) for v in files.values()):
        problems.append(f"task {task_id!r}: {name} must map relative paths to text")
        return
    for path in files:
        if not isinstance(path, str) or len(path) > 200 or not _FILE_PATH.match(path):
            problems.append(
                f"task {task_id!r}: {name} path {path!r} must be relative, without '..', made "
                "of letters, digits, '_', '.', '-' and '/'"
            )


def parse_agent(value: Any, where: str, problems: list[str]) -> None:
    """An agent is "oracle" or {command: [argv...], env: {NAME: value}}."""
    if value == ORACLE:
        return
    if not isinstance(value, Mapping) or set(value) - {"command", "env"}:
        problems.append(f"{where} must be 'oracle' or an object {{command, env}}")
        return
    command = value.get("command")
    if (
        not isinstance(command, list)
        or not 1 <= len(command) <= MAX_AGENT_ARGS
        or not all(isinstance(a, str) and a and "\0" not in a for a in command)
    ):
        problems.append(f"{where}.command must be a list of 1..{MAX_AGENT_ARGS} non-empty strings")
    env = value.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) for k, v in env.items()
    ):
        problems.append(f"{where}.env must map variable names to strings")
    elif reserved := sorted(k for k in env if k in AGENT_RESERVED_ENV or k.startswith("ROLLOUT_")):
        problems.append(f"{where}.env may not set {reserved}: the runner sets those")


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The test commands the grader's harness counts (rollout_worker/sandbox/episode.py
# `harness_plan`, which ships alone and cannot import this; a unit test holds the two alike).
PYTHON_FLAGS = frozenset(("-B", "-b", "-bb", "-u", "-O", "-OO", "-q", "-s", "-E"))
PYTHON_OPTIONS = frozenset(("-W", "-X"))


def countable(argv: list[Any]) -> bool:
    """Whether the grader can count what a test command ran (else: its exit status alone)."""
    if not argv or argv[0] not in ("python", "python3"):
        return False
    rest = list(argv[1:])
    while rest and str(rest[0]).startswith("-") and rest[0] != "-m":
        flag = rest.pop(0)
        if flag in PYTHON_OPTIONS and rest:
            rest.pop(0)
        elif flag not in PYTHON_FLAGS:
            return False
    if len(rest) >= 2 and rest[0] == "-m":
        return rest[1] in ("unittest", "pytest")
    return bool(rest) and str(rest[0]).endswith(".py")


def oracle_problems(tasks: list[Any]) -> list[str]:
    """A task whose agent is the oracle needs the script the oracle runs."""
    return [
        f"task {task.get('id')!r}: the oracle agent needs solution/{SOLVE_SCRIPT}"
        for task in tasks
        if task.get("agent") == ORACLE
        and not task.get("steps")  # each step's solution: task_steps.check_steps
        and SOLVE_SCRIPT not in (task.get("solution") or {})
    ] + [p for task in tasks if task.get("agent") == ORACLE for p in oracle_step_problems(task)]


def parse_tasks(value: Any, problems: list[str]) -> list[Task]:
    """Tasks are data: each one checked here, every problem listed; [] when any has one."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        problems.append("tasks must be a list of task objects")
        return []
    if len(value) > MAX_TASKS:
        problems.append(f"{len(value)} tasks exceed the limit of {MAX_TASKS} per batch")
    size = len(orjson.dumps(value))
    if size > MAX_TASKS_BYTES:
        problems.append(
            f"tasks take {size} bytes encoded, above the {MAX_TASKS_BYTES} bytes a batch may carry "
            "(they travel in the batch's ConfigMap, which the API server caps at 1 MiB): split "
            "the task set into several batches or make the tasks smaller"
        )
    seen: set[str] = set()
    before = len(problems)
    for task in value:
        _check_task(task, seen, problems)
    if len(problems) > before:
        return []
    # Every field was checked above: each object now is what Task describes.
    return [cast(Task, dict(t)) for t in value]


def _check_task(task: Mapping[str, Any], seen: set[str], problems: list[str]) -> None:
    """One task's fields, in the order of its problems; `seen` holds the ids before it."""
    tid = task.get("id")
    unknown = sorted(set(task) - set(TASK_FIELDS))
    if unknown:
        problems.append(f"task {tid!r}: unknown fields {unknown}; allowed: {sorted(TASK_FIELDS)}")
    if not isinstance(tid, str) or not _TASK_ID.match(tid):
        problems.append(f"task id {tid!r} must be 1-63 lower-case letters, digits, '-', '_', '.'")
    elif tid in seen:
        problems.append(f"task id {tid!r} appears twice")
    else:
        seen.add(tid)
    if not isinstance(task.get("statement"), str) or not task.get("statement"):
        problems.append(f"task {tid!r}: statement must be non-empty text")
    _parse_files(tid, "files", task.get("files"), problems)
    if "test_files" in task:
        _parse_files(tid, "test_files", task["test_files"], problems)
    command = task.get("test_command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        problems.append(f"task {tid!r}: test_command must be a non-empty list of strings")
    for name in ("tests", "solution"):
        if name in task:
            _parse_files(tid, name, task[name], problems)
    if "agent" in task:
        parse_agent(task["agent"], f"task {tid!r}: agent", problems)
    problems += oracle_problems([task])
    if not isinstance(task.get("baseline", True), bool):
        problems.append(f"task {tid!r}: baseline must be true or false")
    if task.get("grade", "same") not in GRADES:
        problems.append(f"task {tid!r}: grade {task.get('grade')!r} is not one of {list(GRADES)}")
    _check_reward(task, problems)
    _check_limits(task, problems)
    _check_place(task, problems)
    if "env" in task:
        check_task_env(task["env"], f"task {tid!r}: env", problems)
    if "artifacts" in task:
        check_artifacts(task["artifacts"], f"task {tid!r}: artifacts", problems)
    if "healthcheck" in task:
        check_healthcheck(task["healthcheck"], f"task {tid!r}: healthcheck", problems)
    check_steps(task, problems)


def _check_reward(task: Mapping[str, Any], problems: list[str]) -> None:
    tid, command = task.get("id"), task.get("test_command")
    if task.get("reward", "all") not in REWARD_RULES:
        problems.append(
            f"task {tid!r}: reward {task.get('reward')!r} is not one of {list(REWARD_RULES)}"
        )
    elif task.get("reward") == "fraction" and isinstance(command, list) and not countable(command):
        problems.append(
            f"task {tid!r}: reward fraction needs a test command the grader can count "
            "(python -m unittest, python -m pytest or python <script>.py): a command's own "
            "output is no count of what ran"
        )


def _check_limits(task: Mapping[str, Any], problems: list[str]) -> None:
    for name, default, top in (
        ("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS, MAX_DEADLINE_SECONDS),
        ("max_steps", DEFAULT_MAX_STEPS, MAX_STEPS),
        ("test_timeout_seconds", DEFAULT_TEST_TIMEOUT_SECONDS, MAX_DEADLINE_SECONDS),
    ):
        number = task.get(name, default)
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
            problems.append(f"task {task.get('id')!r}: {name} must be an integer within 1..{top}")


def _check_place(task: Mapping[str, Any], problems: list[str]) -> None:
    """Where the task runs: its workdir and its image."""
    tid, workdir = task.get("id"), task.get("workdir")
    if workdir is not None and (
        not isinstance(workdir, str)
        or not _WORKDIR.match(workdir)
        or workdir.split("/")[1] in _RESERVED_DIRS
        or any(part in (".", "..") for part in workdir.split("/"))
    ):
        problems.append(
            f"task {tid!r}: workdir {workdir!r} must be an absolute path of letters, digits, "
            f"'_', '.', '-', outside {sorted(_RESERVED_DIRS)}"
        )
    image = task.get("image")
    if image is not None and (not isinstance(image, str) or not IMAGE_REFERENCE.match(image)):
        problems.append(f"task {tid!r}: image {image!r} is not a valid image reference")


# A task's env tables (Harbor's [environment.env], [verifier.env], [solution.env]): who sees
# each is the runner's business (the agent, the tests, the oracle). The values travel as
# written: a ${VAR} template is resolved only where the sandbox starts, so no request, receipt,
# ConfigMap or record ever holds what it stands for.
TASK_ENV_TABLES = ("environment", "verifier", "solution")
MAX_TASK_ENV_VARS = 64  # per table
MAX_TASK_ENV_VALUE = 4096  # characters of a value as written (a template or text)
# Where the sandbox's runner finds the host's value of a template's VAR (the local supervisor
# and a Kubernetes Secret reference set it; the runner takes it out of its environment).
TASK_ENV_PREFIX = "ROLLOUT_TASKENV_"
# Names the runner sets itself (the agent's and the tests' environment).
TASK_ENV_RESERVED = ("PATH", "HOME", *AGENT_RESERVED_ENV)
# The whole value: ${VAR} or ${VAR:-default} (Harbor's two forms; text around them is refused
# rather than passed on unexpanded).
_TEMPLATE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?\}$", re.DOTALL)


def env_template(value: str) -> tuple[str, str | None] | None:
    """(VAR, default or None) of a template value; None for plain text."""
    match = _TEMPLATE.match(value)
    return (match.group(1), match.group(2)) if match else None


def _env_name_problem(name: Any) -> str | None:
    if not isinstance(name, str) or len(name) > 128 or not _ENV_NAME.match(name):
        return "is not a variable name ([A-Za-z_][A-Za-z0-9_]*, at most 128)"
    if name in TASK_ENV_RESERVED or name.startswith("ROLLOUT_"):
        return (
            "is set by the runner (ROLLOUT_*, PATH, HOME and the OPENAI_* it points at its proxy)"
        )
    return None


def check_task_env(value: Any, where: str, problems: list[str]) -> None:
    """A task's env: known tables of at most MAX_TASK_ENV_VARS names -> text or a template."""
    if not isinstance(value, Mapping) or set(value) - set(TASK_ENV_TABLES):
        problems.append(f"{where} must be an object of tables {list(TASK_ENV_TABLES)}")
        return
    for table, variables in value.items():
        label = f"{where}.{table}"
        if not isinstance(variables, Mapping) or len(variables) > MAX_TASK_ENV_VARS:
            problems.append(f"{label} must map at most {MAX_TASK_ENV_VARS} names to text")
            continue
        for name, text in variables.items():
            why = _env_name_problem(name)
            if why is not None:
                problems.append(f"{label}: {str(name)[:130]!r} {why}")
            elif not isinstance(text, str) or len(text) > MAX_TASK_ENV_VALUE or "\0" in text:
                problems.append(
                    f"{label}: {name} must be text of at most {MAX_TASK_ENV_VALUE} characters"
                )
            elif "${" in text and env_template(text) is None:
                problems.append(
                    f"{label}: {name} must be text without '${{', or a whole ${{VAR}} / "
                    "${VAR:-default} template"
                )


def env_templates(task: Mapping[str, Any]) -> list[tuple[str, str, str, str | None]]:
    """(table, name, VAR, default) of every template of a task's env, in order."""
    found = []
    env = task.get("env") or {}
    for table in TASK_ENV_TABLES:
        for name, text in (env.get(table) or {}).items():
            template = env_template(text) if isinstance(text, str) else None
            if template is not None:
                found.append((table, name, *template))
    return found


def env_tables_for(task: Mapping[str, Any], grading: bool) -> set[str]:
    """The env tables a task's sandbox needs: a grader's, environment's and verifier's (its
    tests see both, as in Harbor); an agent's, environment's, solution's for the oracle, and
    verifier's when its tests run there too (no hidden `tests`, which a grader's sandbox or
    container runs)."""
    if grading:
        return {"environment", "verifier"}
    tables = {"environment"}
    if task.get("agent") == ORACLE:
        tables.add("solution")
    if "tests" not in task:
        tables.add("verifier")
    return tables


def missing_task_env(tasks: Sequence[Mapping[str, Any]], present: Any) -> list[str]:
    """Each ${VAR} without a default that `present(VAR)` says is not there, naming the task
    and its key: what must refuse a batch before anything of it is created."""
    return [
        f"task {task.get('id')!r}: [{table}.env] {name} = ${{{var}}}: {var} is not set where "
        "the sandboxes start"
        for task in tasks
        for table, name, var, default in env_templates(task)
        if default is None and not present(var)
    ]


# A task's healthcheck (Harbor's [environment.healthcheck], Docker's HEALTHCHECK options):
# field -> (Harbor's default, the largest allowed). Bounded: each attempt and pause is
# sandbox time before the agent starts.
HEALTHCHECK_FIELDS = {
    "interval_seconds": (5.0, 3600.0),
    "timeout_seconds": (30.0, 3600.0),
    "start_period_seconds": (0.0, 3600.0),
    "start_interval_seconds": (5.0, 3600.0),
    "retries": (3, 100),
}
MAX_HEALTHCHECK_COMMAND = 4096


def check_healthcheck(value: Any, where: str, problems: list[str]) -> None:
    if not isinstance(value, Mapping) or set(value) - {"command", *HEALTHCHECK_FIELDS}:
        problems.append(f"{where} must be an object of command and {sorted(HEALTHCHECK_FIELDS)}")
        return
    command = value.get("command")
    if (
        not isinstance(command, str)
        or not command.strip()
        or len(command) > MAX_HEALTHCHECK_COMMAND
        or "\0" in command
    ):
        problems.append(
            f"{where}.command must be a shell command of 1..{MAX_HEALTHCHECK_COMMAND} characters"
        )
    for name, (_, top) in HEALTHCHECK_FIELDS.items():
        number = value.get(name)
        if number is None:
            continue
        low = 1 if name == "retries" else 0
        wrong_type = isinstance(number, bool) or not isinstance(
            number, int if name == "retries" else (int, float)
        )
        if (
            wrong_type
            or not low <= number <= top
            or (name.endswith("interval_seconds") and number <= 0)
        ):
            problems.append(f"{where}.{name} must be a number within {low}..{top:g}")


# A task's artifacts (Harbor's top-level `artifacts`): paths read from the sandbox after the
# tests (the runner's artifacts.py bounds what it reads).
MAX_ARTIFACT_PATHS = 20
_NO_ARTIFACTS_UNDER = ("proc", "sys", "dev")


def check_artifacts(value: Any, where: str, problems: list[str]) -> None:
    if not isinstance(value, list) or len(value) > MAX_ARTIFACT_PATHS:
        problems.append(f"{where} must be a list of at most {MAX_ARTIFACT_PATHS} paths")
        return
    for path in value:
        parts = path.split("/") if isinstance(path, str) else []
        if (
            not isinstance(path, str)
            or not path.strip("/")
            or len(path) > 256
            or "\0" in path
            or ".." in parts
            or (path.startswith("/") and parts[1] in _NO_ARTIFACTS_UNDER)
        ):
            problems.append(
                f"{where}: {str(path)[:260]!r} must be a path (absolute, or relative to the "
                "workspace) of at most 256 characters, without '..', not / itself nor under "
                "/proc, /sys or /dev"
            )

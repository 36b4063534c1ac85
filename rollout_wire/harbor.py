"""Harbor task folders as our tasks (`rollout_wire.request.TASK_FIELDS`).

A Harbor task (harbor-framework/harbor, task.toml schema 1.x) is a folder:

    task.toml         schema_version (or the older `version`), [task], [metadata] (free
                      form), [agent], [verifier], [environment], [solution]: the table below
    instruction.md    what the agent is asked to do
    environment/      the agent's container: a Dockerfile and its build context (or
                      docker-compose.yaml for several containers)
    tests/test.sh     run after the agent, from /tests; writes /logs/verifier/reward.txt (a
                      number) or /logs/verifier/reward.json ({"reward": ..., ...})
    solution/solve.sh optional, what Harbor's oracle agent runs (from /solution)

The mapping (one task per folder):

- id: the folder's name, lower-cased, other characters than [a-z0-9_.-] made '-';
- statement: instruction.md (leading canary comment lines dropped, as Harbor does);
- environment: `[environment] docker_image` -> `image`; else environment/Dockerfile -> `image`
  = a local name whose tag hashes the environment folder (`rollout tasks build` builds it),
  with no `files` (the image holds the workspace); else the folder's plain files -> `files`;
- tests/ -> `tests`, run as `bash /tests/test.sh`, reward `file`, no baseline check (Harbor
  has no rule that the tests fail first); solution/ -> `solution`.

Every task.toml key (Harbor's TaskConfig, schema 1.1, and the keys published task sets use)
is honoured, accepted with a warning, or refused naming the key and the file; a key outside
this table is refused too, unless --allow-unknown-keys makes it a warning (`KNOWN_KEYS`):

  key                             here
  schema_version, version, source descriptive: ignored by design
  [task] name, version, authors   descriptive: ignored by design
  [task] description, keywords    carried into `description` (for people)
  [metadata] (free form)          difficulty, category, tags into `description`; rest ignored
  [agent] timeout_sec             `time_limit_seconds` (rounded up)
  [verifier] timeout_sec          `test_timeout_seconds`: the test command's own limit
  [verifier] environment_mode     shared -> `grade: same`, separate -> `grade: fresh`
  [environment] workdir           `workdir`: the agent's and the tests' working directory
  [environment] docker_image      `image`
  [environment] cpus, memory_mb   the batch's --cpu-limit / --memory-limit default to the
                                  largest stated; a smaller flag is refused (rollout run)
  [agent|verifier] user           1000 (the sandbox's uid) honoured; root and any other user
                                  refused (sandboxes run as uid 1000, never root)
  network_mode ([agent],          "no-network"/"none" honoured (sandboxes have no network);
  [verifier], [environment])      public/allowlist refused
  [environment] allow_internet    false honoured; true refused (no network)
  allowed_hosts (any section)     empty accepted; any host refused (no network)
  [environment] gpus, gpu_types   0 / empty accepted; GPUs refused
  [environment] storage_mb        accepted with a warning: no per-sandbox disk limit here
  [environment] build_timeout_sec accepted with a warning: `rollout tasks build` builds first
  [environment] mcp_servers       refused unless empty (no MCP servers)
  [environment] skills_dir        refused (skills are not copied to agents)
  [environment] healthcheck       refused (not run: the agent would start before it passed)
  [environment] memory, storage   refused (deprecated: write memory_mb, storage_mb)
  [environment.env], [verifier.env], [solution.env]
                                  refused: variables are not carried yet (a resolved secret
                                  would land in receipts and reports)
  [verifier.environment]          refused (a separate verifier environment definition)
  artifacts                       refused (not collected into the records)
  [[steps]], multi_step_reward_strategy
                                  refused (multi-step tasks); so is a steps/ folder

Also refused: docker-compose environments (one sandbox per episode) and Windows tests.

A task folder is hostile input: it is read without following any symbolic link (a link could
carry a host file, /etc/passwd or ~/.ssh, into the statement, Redis and a ConfigMap) and
without opening FIFOs, devices or sockets (reading one blocks or reaches the host). Each is
refused, naming the task and the path.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import DEFAULT_TASK_TIME_LIMIT_SECONDS

TASK_TOML = "task.toml"
INSTRUCTION = "instruction.md"
TEST_SCRIPT = "test.sh"
SOLVE_SCRIPT = "solve.sh"
TEST_COMMAND = ["bash", "/tests/test.sh"]
# Images built from a task's Dockerfile get this registry-looking prefix: never pulled from
# anywhere (the local Docker and the node's containerd hold them), and `--push` swaps it.
LOCAL_REGISTRY = "rollout.local"
# Tasks travel inside the batch request (< 1 MiB in all), so any one file must be smaller.
MAX_FILE_BYTES = 1024 * 1024
MAX_DESCRIPTION = 300
_COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
# Clutter that is never part of a task (editors, VCS, bytecode).
_SKIPPED = frozenset({".git", "__pycache__", ".DS_Store", ".gitkeep"})
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_NOT_ID = re.compile(r"[^a-z0-9_.-]+")
_MAX_ID = 63


@dataclass(frozen=True)
class HarborTask:
    """One mapped task, where it came from, and the folder to `docker build` (None: no build)."""

    task: dict[str, Any]
    folder: Path
    build_dir: Path | None
    # What the task asks of the sandbox ([environment] cpus, memory_mb) when it says so: the
    # batch's limits default to the largest (`rollout run`), and a smaller flag is refused.
    requirements: dict[str, int] = field(default_factory=dict)
    # Keys accepted without being enforced, and unknown keys let through by
    # --allow-unknown-keys: shown to the user at submission, never silent.
    warnings: tuple[str, ...] = ()

    @property
    def task_id(self) -> str:
        return str(self.task["id"])


def task_id_of(name: str) -> str:
    """A folder name as a task id (request.py's rule: 1-63 of [a-z0-9_.-], alphanumeric ends);
    "" when nothing usable is left."""
    text = _NOT_ID.sub("-", name.lower())
    text = text.strip("-_.")[:_MAX_ID]
    return text.rstrip("-_.")


def is_harbor_folder(path: str | Path) -> bool:
    """A Harbor task folder, or a folder whose subfolders include one."""
    return bool(_task_folders(Path(path)))


def _task_folders(path: Path) -> list[Path]:
    # Any task.toml entry marks a task (a link or FIFO too: _map_task refuses it by name
    # rather than the folder silently not being one); linked subfolders are kept to be refused.
    if not path.is_dir():
        return []
    if os.path.lexists(path / TASK_TOML):
        return [path.resolve()]  # its name is the task id, even when given as "."
    return sorted(
        child
        for child in path.iterdir()
        if child.is_dir() and not child.name.startswith(".") and os.path.lexists(child / TASK_TOML)
    )


def load_harbor_tasks(
    path: str | Path, only: Iterable[str] | None = None, allow_unknown_keys: bool = False
) -> list[dict[str, Any]]:
    """The tasks of a Harbor folder (one task's folder, or a folder of them), in folder order;
    `only` keeps these task ids. Raises InvalidSpec listing every task that cannot be mapped."""
    return [h.task for h in scan(path, only, allow_unknown_keys)]


def harbor_images(
    path: str | Path, only: Iterable[str] | None = None
) -> list[tuple[str, str, Path]]:
    """(image, task id, environment folder) of every task whose image is built from its
    Dockerfile: what `rollout tasks build` builds."""
    return [(h.task["image"], h.task_id, h.build_dir) for h in scan(path, only) if h.build_dir]


def scan(
    path: str | Path, only: Iterable[str] | None = None, allow_unknown_keys: bool = False
) -> list[HarborTask]:
    """Every task of the folder mapped, or InvalidSpec with every problem of every task;
    `allow_unknown_keys` makes an unknown task.toml key a warning (HarborTask.warnings)."""
    root = Path(path)
    folders = _task_folders(root)
    if not folders:
        where = "no such folder" if not root.is_dir() else f"no {TASK_TOML} in it or a subfolder"
        raise InvalidSpec([f"Harbor task folder {str(root)!r}: {where}"])
    problems: list[str] = []
    by_id: dict[str, list[Path]] = {}
    for folder in folders:
        task_id = task_id_of(folder.name)
        if not task_id:
            problems.append(f"task folder {folder.name!r}: its name leaves no usable task id")
            continue
        by_id.setdefault(task_id, []).append(folder)
    for task_id, same in by_id.items():
        if len(same) > 1:
            names = ", ".join(repr(f.name) for f in same)
            problems.append(f"task folders {names} all map to task id {task_id!r}: rename one")
    wanted = None if only is None else list(only)
    if wanted is not None:
        missing = [name for name in wanted if name not in by_id]
        if missing:
            problems.append(f"Harbor task folder {str(root)!r} has no task(s) {missing}")
    mapped = []
    for task_id, same in by_id.items():
        if len(same) == 1 and (wanted is None or task_id in wanted):
            task = _map_task(task_id, same[0], problems, allow_unknown_keys)
            if task is not None:
                mapped.append(task)
    if problems:
        raise InvalidSpec(problems)
    return sorted(mapped, key=lambda h: h.folder.name)


def _table(config: dict[str, Any], name: str, where: str, problems: list[str]) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        problems.append(f"{where}: [{name}] in {TASK_TOML} must be a table")
        return {}
    return value


def _map_task(
    task_id: str, folder: Path, problems: list[str], allow_unknown_keys: bool = False
) -> HarborTask | None:
    where = f"task {folder.name!r}"
    before = len(problems)
    if folder.is_symlink():
        problems.append(f"{where}: the task folder is a symbolic link{_LINK_WHY}")
        return None
    if not _is(folder / TASK_TOML, TASK_TOML, "file", where, problems):
        return None
    toml_text = _read_text(folder / TASK_TOML, where, problems)
    if toml_text is None:
        return None
    try:
        config = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{where}: {TASK_TOML} is not valid TOML: {exc}")
        return None
    agent = _table(config, "agent", where, problems)
    verifier = _table(config, "verifier", where, problems)
    environment = _table(config, "environment", where, problems)
    _table(config, "solution", where, problems)
    _table(config, "task", where, problems)
    toml_name = f"{folder.name}/{TASK_TOML}"
    warnings: list[str] = []
    _check_keys(config, toml_name, where, problems, warnings, allow_unknown_keys)
    _refuse_unsupported(folder, config, environment, verifier, where, problems)
    task: dict[str, Any] = {"id": task_id}
    description = _description(config)
    if description:
        task["description"] = description
    instruction = folder / INSTRUCTION
    if _kind(instruction) == "missing":
        problems.append(f"{where}: no {INSTRUCTION}")
    elif _is(instruction, INSTRUCTION, "file", where, problems):
        statement = _strip_canary(_read_text(instruction, where, problems) or "")
        if not statement.strip():
            problems.append(f"{where}: {INSTRUCTION} is empty")
        task["statement"] = statement

    build_dir = None
    env_dir = folder / "environment"
    has_env = _folder(env_dir, "environment", where, problems)
    prebuilt = environment.get("docker_image")
    if prebuilt is not None:
        if not isinstance(prebuilt, str) or not prebuilt:
            problems.append(f"{where}: [environment] docker_image must be an image name")
        task["image"] = prebuilt
        task["files"] = {}
    elif has_env and _kind(env_dir / "Dockerfile") not in ("missing", "dir"):
        # The build context goes to `docker build` and is hashed for the tag: checked first,
        # so neither follows a link nor opens a FIFO.
        seen = len(problems)
        _read_tree(env_dir, where, problems, read=False)
        if len(problems) == seen:
            build_dir = env_dir
            task["image"] = local_image_name(task_id, env_dir)
        task["files"] = {}
    else:
        task["files"] = _read_tree(env_dir, where, problems) if has_env else {}

    tests_dir = folder / "tests"
    if _folder(tests_dir, "tests", where, problems) and _kind(tests_dir / TEST_SCRIPT) != "missing":
        task["tests"] = _read_tree(tests_dir, where, problems)  # refuses a linked test.sh too
    elif _kind(tests_dir) in ("missing", "dir"):
        problems.append(f"{where}: no tests/{TEST_SCRIPT} (Harbor's verifier entry point)")
    task["test_command"] = list(TEST_COMMAND)
    task["reward"] = "file"
    task["baseline"] = False
    solution_dir = folder / "solution"
    if _folder(solution_dir, "solution", where, problems):
        task["solution"] = _read_tree(solution_dir, where, problems)
    task["time_limit_seconds"] = _time_limit(agent.get("timeout_sec"), where, problems)
    _honour(task, agent, verifier, environment, where, problems, warnings)
    if len(problems) > before:
        return None
    return HarborTask(
        task=task,
        folder=folder,
        build_dir=build_dir,
        requirements=_requirements(environment, where, problems),
        warnings=tuple(warnings),
    )


# Harbor's task.toml keys (harbor-framework/harbor models/task/config.py, schema 1.1, plus
# the keys published task sets use: workdir, environment_mode, artifacts, [[steps]]). A key
# outside these is unknown: refused by name unless --allow-unknown-keys. Free-form tables
# ([metadata], the env tables) are not walked.
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {
            "schema_version",
            "version",
            "source",
            "task",
            "metadata",
            "agent",
            "verifier",
            "environment",
            "solution",
            "artifacts",
            "steps",
            "multi_step_reward_strategy",
        }
    ),
    "task": frozenset({"name", "version", "description", "authors", "keywords"}),
    "agent": frozenset({"timeout_sec", "user", "network_mode", "allowed_hosts"}),
    "verifier": frozenset(
        {
            "timeout_sec",
            "env",
            "user",
            "network_mode",
            "allowed_hosts",
            "environment_mode",
            "environment",
        }
    ),
    "environment": frozenset(
        {
            "build_timeout_sec",
            "docker_image",
            "cpus",
            "memory_mb",
            "storage_mb",
            "gpus",
            "gpu_types",
            "allow_internet",
            "network_mode",
            "allowed_hosts",
            "mcp_servers",
            "env",
            "skills_dir",
            "healthcheck",
            "workdir",
            "memory",
            "storage",
        }
    ),
    "solution": frozenset({"env"}),
}
# Refused whenever present (with any value), and why.
REFUSED_KEYS: dict[str, str] = {
    "steps": "multi-step tasks ([[steps]]) are not supported",
    "multi_step_reward_strategy": "multi-step tasks are not supported",
    "artifacts": "artifacts are not collected into the records",
    "verifier.environment": "a separate verifier environment definition is not supported "
    '(environment_mode = "separate" grades in a fresh sandbox of the task\'s own environment)',
    "environment.healthcheck": "healthchecks are not run (the agent would start before the "
    "environment is ready)",
    "environment.skills_dir": "skills are not copied to agents",
    "environment.memory": "deprecated; write memory_mb",
    "environment.storage": "deprecated; write storage_mb",
    "environment.env": "environment variables are not carried yet (the agent would run "
    "without them)",
    "verifier.env": "environment variables are not carried yet (the tests would run without them)",
    "solution.env": "environment variables are not carried yet (the oracle would run without them)",
}
# The sandbox's only user (uid 1000, non-root): a task asking for it is honoured as is.
SANDBOX_USERS = ("1000", 1000)
# Harbor's spellings of "no network" (ours: a sandbox never has one).
NO_NETWORK = ("no-network", "none")
_WORKDIR = re.compile(r"^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_SYSTEM_DIRS = frozenset({"proc", "dev", "sys", "sandbox", "tmp", "logs", "tests", "solution"})


def _check_keys(
    config: dict[str, Any],
    toml_name: str,
    where: str,
    problems: list[str],
    warnings: list[str],
    allow_unknown_keys: bool,
) -> None:
    """Every key of task.toml is known; a known key that is refused whenever present is
    refused here, by name."""
    for section, known in KNOWN_KEYS.items():
        table = config if not section else config.get(section, {})
        if not isinstance(table, dict):
            continue
        for key in table:
            dotted = f"{section}.{key}" if section else key
            label = f"[{section}] {key}" if section else key
            if key not in known:
                message = f"{where}: unknown key {label} in {toml_name}"
                if allow_unknown_keys:
                    warnings.append(f"{message}: ignored (--allow-unknown-keys)")
                else:
                    problems.append(
                        f"{message}: not honoured here (--allow-unknown-keys lets it through "
                        "as a warning)"
                    )
            elif dotted in REFUSED_KEYS and _present(table[key]):
                problems.append(f"{where}: {label} in {toml_name}: {REFUSED_KEYS[dotted]}")


def _present(value: Any) -> bool:
    # An empty table or list asks for nothing (Harbor's defaults written out).
    return value is not None and value != {} and value != []


def _refuse_unsupported(
    folder: Path,
    config: dict[str, Any],
    environment: dict[str, Any],
    verifier: dict[str, Any],
    where: str,
    problems: list[str],
) -> None:
    env_dir = folder / "environment"
    compose = [name for name in _COMPOSE_FILES if (env_dir / name).is_file()]
    if compose:
        problems.append(
            f"{where}: environment/{compose[0]} (several containers) is not supported: one "
            "sandbox per episode; give the task an environment/Dockerfile instead"
        )
    if not config.get("steps") and (folder / "steps").is_dir():
        problems.append(f"{where}: multi-step tasks (steps/) are not supported")
    gpus = environment.get("gpus", 0)
    if gpus:
        problems.append(f"{where}: [environment] gpus = {gpus!r}: GPUs are not supported")
    if environment.get("gpu_types"):
        problems.append(f"{where}: [environment] gpu_types: GPUs are not supported")
    if environment.get("mcp_servers"):
        problems.append(f"{where}: [environment] mcp_servers are not supported")
    tests_dir = folder / "tests"
    if (tests_dir / "test.bat").is_file() and not (tests_dir / TEST_SCRIPT).is_file():
        problems.append(f"{where}: Windows tasks (tests/test.bat) are not supported")


def _honour(
    task: dict[str, Any],
    agent: dict[str, Any],
    verifier: dict[str, Any],
    environment: dict[str, Any],
    where: str,
    problems: list[str],
    warnings: list[str],
) -> None:
    """The keys that change how the episode runs, mapped onto the task or refused by name."""
    timeout = verifier.get("timeout_sec")
    if timeout is not None:
        task["test_timeout_seconds"] = _seconds(timeout, "[verifier] timeout_sec", where, problems)
    mode = verifier.get("environment_mode")
    if mode is not None:
        grades = {"shared": "same", "separate": "fresh"}
        if mode in grades:
            task["grade"] = grades[mode]
        else:
            problems.append(
                f"{where}: [verifier] environment_mode {mode!r} is not 'shared' or 'separate'"
            )
    workdir = environment.get("workdir")
    if workdir is not None:
        if (
            not isinstance(workdir, str)
            or len(workdir) > 200
            or not _WORKDIR.match(workdir)
            or any(part in (".", "..") for part in workdir.split("/"))
            or workdir.split("/")[1] in _SYSTEM_DIRS
        ):
            problems.append(
                f"{where}: [environment] workdir {workdir!r} must be an absolute path of "
                "letters, digits, '_', '.', '-', outside /proc, /dev, /sys, /tmp, /logs, "
                "/tests, /solution and /sandbox"
            )
        else:
            task["workdir"] = workdir
    for section, table in (("agent", agent), ("verifier", verifier), ("environment", environment)):
        network = table.get("network_mode")
        if network is not None and network not in NO_NETWORK:
            problems.append(
                f"{where}: [{section}] network_mode {network!r}: sandboxes have no network "
                "(only 'no-network' is honoured)"
            )
        if table.get("allowed_hosts"):
            problems.append(
                f"{where}: [{section}] allowed_hosts: sandboxes have no network, no host can "
                "be allowed"
            )
    internet = environment.get("allow_internet")
    if internet is not None and internet is not False:
        problems.append(
            f"{where}: [environment] allow_internet = {internet!r}: sandboxes have no network "
            "(write false, or drop the key)"
        )
    for section, table in (("agent", agent), ("verifier", verifier)):
        user = table.get("user")
        if user is None or (user in SANDBOX_USERS and not isinstance(user, bool)):
            continue
        why = (
            "sandboxes never run as root"
            if user in ("root", 0)
            else "the sandbox runs as uid 1000 only (write 1000, or drop the key)"
        )
        problems.append(f"{where}: [{section}] user = {user!r}: {why}")
    for key, why in (
        ("storage_mb", "no per-sandbox disk limit here"),
        ("build_timeout_sec", "`rollout tasks build` builds the image before the batch"),
    ):
        value = environment.get(key)
        if value is not None:
            _seconds(value, f"[environment] {key}", where, problems)  # still a number
            warnings.append(f"{where}: [environment] {key} = {value!r} not enforced: {why}")


def _seconds(value: Any, label: str, where: str, problems: list[str]) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        problems.append(f"{where}: {label} must be a positive number, got {value!r}")
        return 1
    return math.ceil(value)


def _requirements(environment: dict[str, Any], where: str, problems: list[str]) -> dict[str, int]:
    """[environment] cpus and memory_mb as the task states them (unstated: nothing asked, the
    batch's limits stand)."""
    wanted: dict[str, int] = {}
    for key in ("cpus", "memory_mb"):
        value = environment.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e7:
            problems.append(f"{where}: [environment] {key} must be a positive number")
            continue
        wanted[key] = math.ceil(value)
    return wanted


def _time_limit(value: Any, where: str, problems: list[str]) -> int:
    if value is None:
        return DEFAULT_TASK_TIME_LIMIT_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        problems.append(f"{where}: [agent] timeout_sec must be a positive number, got {value!r}")
        return DEFAULT_TASK_TIME_LIMIT_SECONDS
    return math.ceil(value)


def _description(config: dict[str, Any]) -> str:
    """A short line for people: the task's own description, then a few metadata keys."""
    parts: list[str] = []
    package = config.get("task")
    metadata = config.get("metadata")
    package = package if isinstance(package, dict) else {}
    metadata = metadata if isinstance(metadata, dict) else {}
    text = package.get("description")
    if isinstance(text, str) and text.strip():
        parts.append(" ".join(text.split()).rstrip("."))
    for key in ("difficulty", "category"):
        value = metadata.get(key)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value):
            parts.append(f"{key}: {value}")
    tags = metadata.get("tags") or package.get("keywords")
    if isinstance(tags, list) and tags and all(isinstance(t, str) for t in tags):
        parts.append("tags: " + ", ".join(tags))
    line = "; ".join(parts)
    return line if len(line) <= MAX_DESCRIPTION else line[: MAX_DESCRIPTION - 3] + "..."


def _strip_canary(text: str) -> str:
    """Drop leading canary marker lines (data-provenance comments not meant for the agent) and
    the blank lines after them."""
    lines = text.split("\n")
    start = 0
    while start < len(lines) and _CANARY.match(lines[start].strip()):
        start += 1
    if start:
        while start < len(lines) and not lines[start].strip():
            start += 1
    return "\n".join(lines[start:])


_LINK_WHY = "; a task folder is read without following links (it could name a host file)"


def _kind(path: Path) -> str:
    """What is at `path`, the last component not followed: missing, link, dir, file, or
    special (FIFO, device, socket)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "special"


def _is(path: Path, name: str, want: str, where: str, problems: list[str]) -> bool:
    """Whether `path` is a `want` ("file" or "dir"); otherwise a problem naming it."""
    kind = _kind(path)
    if kind == want:
        return True
    if kind == "link":
        problems.append(f"{where}: {name} is a symbolic link{_LINK_WHY}")
    elif kind == "missing":
        problems.append(f"{where}: no {name}")
    else:
        problems.append(f"{where}: {name} is not a plain {'file' if want == 'file' else 'folder'}")
    return False


def _folder(path: Path, name: str, where: str, problems: list[str]) -> bool:
    """Whether the task has this folder: False when it has none, and a problem too when it is a
    link or not a folder."""
    return _kind(path) != "missing" and _is(path, name, "dir", where, problems)


def _read_text(path: Path, where: str, problems: list[str], name: str | None = None) -> str | None:
    """A file's text, or a problem naming it: only text below MAX_FILE_BYTES travels."""
    name = name or path.name
    # O_NOFOLLOW: a file swapped for a link after it was checked is still not followed;
    # O_NONBLOCK: nor does a FIFO block the open (fstat refuses it).
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            problems.append(f"{where}: {name} is a symbolic link{_LINK_WHY}")
        else:
            problems.append(f"{where}: {name} cannot be read: {exc.strerror}")
        return None
    with open(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            problems.append(f"{where}: {name} is not a plain file")
            return None
        size = info.st_size
        if size > MAX_FILE_BYTES:
            problems.append(f"{where}: {name} is {size} bytes, above the {MAX_FILE_BYTES} allowed")
            return None
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # grew since fstat
        problems.append(f"{where}: {name} is above the {MAX_FILE_BYTES} bytes allowed")
        return None
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), len(data), "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        problems.append(f"{where}: {name} is a binary file; only UTF-8 text can be carried")
        return None


def _walk(root: Path) -> Iterable[tuple[str, Path]]:
    """(relative posix path, path) of every entry below `root`, sorted, clutter left out; no
    symbolic link is followed."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED)
        base = Path(dirpath)
        for name in sorted([*dirnames, *filenames]):
            if name not in _SKIPPED:
                yield (base / name).relative_to(root).as_posix(), base / name


def _read_tree(root: Path, where: str, problems: list[str], read: bool = True) -> dict[str, str]:
    """path -> text of every file below `root` (a folder of the task, itself no link), links
    and special files refused; `read=False` only checks."""
    files: dict[str, str] = {}
    for rel, path in _walk(root):
        name = f"{root.name}/{rel}"
        kind = _kind(path)
        if kind == "link":
            problems.append(f"{where}: {name} is a symbolic link{_LINK_WHY}")
        elif kind == "special":
            problems.append(f"{where}: {name} is not a plain file")
        elif kind == "file" and read:
            text = _read_text(path, where, problems, name)
            if text is not None:
                files[rel] = text
    return files


def environment_digest(env_dir: Path) -> str:
    """12 hex of a hash over the folder's names, contents, executable bits and link targets:
    the same build context always gives the same tag, any change a new one."""
    digest = hashlib.sha256()
    for rel, path in _walk(env_dir):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            digest.update(f"L\0{rel}\0{os.readlink(path)}\n".encode())
        elif stat.S_ISDIR(mode):
            digest.update(f"D\0{rel}\n".encode())
        elif not stat.S_ISREG(mode):
            digest.update(f"S\0{rel}\n".encode())  # a FIFO is never opened: it would block
        else:
            executable = int(bool(mode & stat.S_IXUSR))
            content = hashlib.sha256(path.read_bytes()).hexdigest()
            digest.update(f"F\0{rel}\0{executable}\0{content}\n".encode())
    return digest.hexdigest()[:12]


def local_image_name(task_id: str, env_dir: Path) -> str:
    # An image path component allows single separators only; a task id may have runs of them.
    name = re.sub(r"[^a-z0-9]+", "-", task_id).strip("-")
    return f"{LOCAL_REGISTRY}/harbor-{name}:{environment_digest(env_dir)}"

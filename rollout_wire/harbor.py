"""Harbor task folders as our tasks (`rollout_wire.task_spec.TASK_FIELDS`).

A Harbor task (harbor-framework/harbor, task.toml schema 1.x) is a folder:

    task.toml         schema_version (or the older `version`), [task], [metadata] (free
                      form), [agent], [verifier], [environment], [solution]: see harbor_keys
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

The keys of task.toml and what is done with each: `rollout_wire.harbor_keys`; how the folder
is read (never following a link): `rollout_wire.harbor_files`.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tomllib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_wire.errors import InvalidSpec, TaskWarning
from rollout_wire.harbor_files import (
    INSTRUCTION,
    LINK_WHY,
    MAX_FILE_BYTES,
    TASK_TOML,
    TEST_SCRIPT,
    dockerfile_workdir,
    has_folder,
    is_kind,
    kind_of,
    read_text,
    read_tree,
    walk,
)
from rollout_wire.harbor_keys import (
    KNOWN_KEYS,
    REFUSED_KEYS,
    TomlTables,
    check_keys,
    check_workdir,
    honour,
    refuse_unsupported,
    requirements,
    time_limit,
)
from rollout_wire.harbor_steps import map_steps
from rollout_wire.task_spec import SOLVE_SCRIPT

# Re-exported: the names this module had before the key table and the folder reading moved.
__all__ = [
    "INSTRUCTION",
    "KNOWN_KEYS",
    "LOCAL_REGISTRY",
    "MAX_DESCRIPTION",
    "MAX_FILE_BYTES",
    "REFUSED_KEYS",
    "SOLVE_SCRIPT",
    "TASK_TOML",
    "TEST_COMMAND",
    "TEST_SCRIPT",
    "HarborTask",
    "environment_digest",
    "harbor_images",
    "is_harbor_folder",
    "load_harbor_tasks",
    "local_image_name",
    "scan",
    "task_id_of",
]

TEST_COMMAND = ["bash", f"/tests/{TEST_SCRIPT}"]
# Images built from a task's Dockerfile get this registry-looking prefix: never pulled from
# anywhere (the local Docker and the node's containerd hold them), and `--push` swaps it.
LOCAL_REGISTRY = "rollout.local"
MAX_DESCRIPTION = 300
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
    """A folder name as a task id (task_spec's rule: 1-63 of [a-z0-9_.-], alphanumeric ends);
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
    `only` keeps these task ids. Raises InvalidSpec listing every task that cannot be mapped;
    each key let through but not honoured is a TaskWarning (a trainer loading tasks in Python
    sees it as a command line user does)."""
    mapped = scan(path, only, allow_unknown_keys)
    for h in mapped:
        for warning in h.warnings:
            warnings.warn(warning, TaskWarning, stacklevel=3)
    return [h.task for h in mapped]


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


def _read_config(folder: Path, where: str, problems: list[str]) -> TomlTables | None:
    """task.toml parsed, its tables checked to be tables; None (and a problem) when unreadable."""
    if folder.is_symlink():
        problems.append(f"{where}: the task folder is a symbolic link{LINK_WHY}")
        return None
    if not is_kind(folder / TASK_TOML, TASK_TOML, "file", where, problems):
        return None
    toml_text = read_text(folder / TASK_TOML, where, problems)
    if toml_text is None:
        return None
    try:
        config = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{where}: {TASK_TOML} is not valid TOML: {exc}")
        return None
    tables = TomlTables(
        config=config,
        agent=_table(config, "agent", where, problems),
        verifier=_table(config, "verifier", where, problems),
        environment=_table(config, "environment", where, problems),
    )
    _table(config, "solution", where, problems)
    _table(config, "task", where, problems)
    return tables


def _map_task(
    task_id: str, folder: Path, problems: list[str], allow_unknown_keys: bool = False
) -> HarborTask | None:
    where = f"task {folder.name!r}"
    before = len(problems)
    tables = _read_config(folder, where, problems)
    if tables is None:
        return None
    warnings: list[str] = []
    check_keys(
        tables.config, f"{folder.name}/{TASK_TOML}", where, problems, warnings, allow_unknown_keys
    )
    refuse_unsupported(folder, tables.config, tables.environment, where, problems)
    task: dict[str, Any] = {"id": task_id}
    description = _description(tables.config)
    if description:
        task["description"] = description
    multi_step = "steps" in tables.config
    if not multi_step:
        _read_statement(task, folder, where, problems)
    build_dir = _read_environment(task, folder, tables.environment, where, problems)
    if not multi_step:
        _read_tests_and_solution(task, folder, where, problems)
    else:
        task["test_command"], task["reward"], task["baseline"] = list(TEST_COMMAND), "file", False
    task["time_limit_seconds"] = time_limit(tables.agent.get("timeout_sec"), where, problems)
    honour(task, tables, where, problems, warnings)
    if multi_step:
        map_steps(task, folder, tables.config, where, problems)
        # Harbor never shows the root instruction.md of a task with steps: the task's
        # statement (for people, and a step's default) is the first step's.
        if task.get("steps"):
            task["statement"] = task["steps"][0]["statement"]
    if len(problems) > before:
        return None
    return HarborTask(
        task=task,
        folder=folder,
        build_dir=build_dir,
        requirements=requirements(tables.environment, where, problems),
        warnings=tuple(warnings),
    )


def _read_statement(task: dict[str, Any], folder: Path, where: str, problems: list[str]) -> None:
    instruction = folder / INSTRUCTION
    if kind_of(instruction) == "missing":
        problems.append(f"{where}: no {INSTRUCTION}")
    elif is_kind(instruction, INSTRUCTION, "file", where, problems):
        statement = _strip_canary(read_text(instruction, where, problems) or "")
        if not statement.strip():
            problems.append(f"{where}: {INSTRUCTION} is empty")
        task["statement"] = statement


def _read_environment(
    task: dict[str, Any],
    folder: Path,
    environment: dict[str, Any],
    where: str,
    problems: list[str],
) -> Path | None:
    """The task's image or files (see the module's mapping); the folder to build, if any."""
    build_dir = None
    env_dir = folder / "environment"
    has_env = has_folder(env_dir, "environment", where, problems)
    prebuilt = environment.get("docker_image")
    if prebuilt is not None:
        if not isinstance(prebuilt, str) or not prebuilt:
            problems.append(f"{where}: [environment] docker_image must be an image name")
        task["image"] = prebuilt
        task["files"] = {}
    elif has_env and kind_of(env_dir / "Dockerfile") not in ("missing", "dir"):
        # The build context goes to `docker build` and is hashed for the tag: checked first,
        # so neither follows a link nor opens a FIFO.
        seen = len(problems)
        read_tree(env_dir, where, problems, read=False)
        if len(problems) == seen:
            build_dir = env_dir
            task["image"] = local_image_name(str(task["id"]), env_dir)
            if environment.get("workdir") is None:
                _dockerfile_workdir(task, env_dir, where, problems)
        task["files"] = {}
    else:
        task["files"] = read_tree(env_dir, where, problems) if has_env else {}
    return build_dir


def _dockerfile_workdir(
    task: dict[str, Any], env_dir: Path, where: str, problems: list[str]
) -> None:
    """Without [environment] workdir, the Dockerfile's own WORKDIR is the task's: else
    Kubernetes would run the agent in /workspace where the local backend uses the image's."""
    text = read_text(env_dir / "Dockerfile", where, problems, "environment/Dockerfile")
    workdir = dockerfile_workdir(text) if text is not None else None
    if workdir is not None:
        check_workdir(task, workdir, "environment/Dockerfile WORKDIR", where, problems)


def _read_tests_and_solution(
    task: dict[str, Any], folder: Path, where: str, problems: list[str]
) -> None:
    tests_dir = folder / "tests"
    if (
        has_folder(tests_dir, "tests", where, problems)
        and kind_of(tests_dir / TEST_SCRIPT) != "missing"
    ):
        task["tests"] = read_tree(tests_dir, where, problems)  # refuses a linked test.sh too
    elif kind_of(tests_dir) in ("missing", "dir"):
        problems.append(f"{where}: no tests/{TEST_SCRIPT} (Harbor's verifier entry point)")
    task["test_command"] = list(TEST_COMMAND)
    task["reward"] = "file"
    task["baseline"] = False
    solution_dir = folder / "solution"
    if has_folder(solution_dir, "solution", where, problems):
        task["solution"] = read_tree(solution_dir, where, problems)


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


def environment_digest(env_dir: Path) -> str:
    """12 hex of a hash over the folder's names, contents, executable bits and link targets:
    the same build context always gives the same tag, any change a new one."""
    digest = hashlib.sha256()
    for rel, path in walk(env_dir):
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

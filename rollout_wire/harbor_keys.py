"""The task.toml keys of a Harbor task (`rollout_wire.harbor`) and what is done with each.

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
  [environment] workdir           `workdir`: the agent's and the tests' working directory;
                                  unset, an environment/Dockerfile's last literal absolute
                                  WORKDIR (final stage, no $VAR) is the task's, so both
                                  backends work in the image's folder
  [environment] docker_image      `image`
  [environment] cpus, memory_mb,  the batch's --cpu-limit / --memory-limit / --storage-limit
  storage_mb                      default to the largest stated; a smaller flag is refused
                                  (rollout run). storage_mb: Kubernetes' ephemeral-storage
                                  limit and each disk emptyDir's sizeLimit; locally the
                                  supervisor measures the episode's on-disk folders every
                                  second. Past it the episode is the agent's failure
  [agent|verifier] user           1000 (the sandbox's uid) honoured; root and any other user
                                  refused (sandboxes run as uid 1000, never root)
  network_mode ([agent],          "no-network"/"none" honoured (sandboxes have no network);
  [verifier], [environment])      public/allowlist refused
  [environment] allow_internet    false honoured; true refused (no network)
  allowed_hosts (any section)     empty accepted; any host refused (no network)
  [environment] gpus, gpu_types   0 / empty accepted; GPUs refused
  [environment] build_timeout_sec accepted with a warning: `rollout tasks build` builds first
  [environment] mcp_servers       refused unless empty (no MCP servers)
  [environment] skills_dir        refused (skills are not copied to agents)
  [environment.healthcheck]       `healthcheck`: run in the sandbox before the agent (Docker's
                                  HEALTHCHECK rules, Harbor's defaults) until it passes; one
                                  that never does fails the episode as infrastructure
  [environment] memory, storage   refused (deprecated: write memory_mb, storage_mb)
  [environment.env], [verifier.env], [solution.env]
                                  the task's `env`, as written: text, ${VAR} or
                                  ${VAR:-default}, resolved only where the sandbox starts
                                  (local: the workers' environment; a ${VAR} they lack refuses
                                  the batch; Kubernetes: templates refused for now). The agent
                                  sees environment's, the tests environment's + verifier's,
                                  the oracle environment's + solution's; runner names
                                  (ROLLOUT_*, PATH, HOME, OPENAI_*) refused
  [verifier.environment]          refused (a separate verifier environment definition)
  artifacts                       `artifacts`: paths (or tables of `source`) read from the
                                  sandbox after the tests into the reward event (the
                                  episode's log record): bounded, never through a link, each
                                  refusal named; a table's other keys refused
  [[steps]], multi_step_reward_strategy
                                  `steps` and `step_reward_strategy` (mean, final): each
                                  step's keys and folder in rollout_wire.harbor_steps; a
                                  steps/ folder without [[steps]] refused

Also refused: docker-compose environments (one sandbox per episode) and Windows tests.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_wire.harbor_files import TASK_TOML, TEST_SCRIPT
from rollout_wire.task_spec import (
    DEFAULT_TASK_TIME_LIMIT_SECONDS,
    check_artifacts,
    check_healthcheck,
    check_task_env,
)

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


@dataclass(frozen=True)
class TomlTables:
    """A task.toml, and the tables the mapping reads (each {} when absent or not a table)."""

    config: dict[str, Any]
    agent: dict[str, Any]
    verifier: dict[str, Any]
    environment: dict[str, Any]


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
    "verifier.environment": "a separate verifier environment definition is not supported "
    '(environment_mode = "separate" grades in a fresh sandbox of the task\'s own environment)',
    "environment.skills_dir": "skills are not copied to agents",
    "environment.memory": "deprecated; write memory_mb",
    "environment.storage": "deprecated; write storage_mb",
}
# The sandbox's only user (uid 1000, non-root): a task asking for it is honoured as is.
SANDBOX_USERS = ("1000", 1000)
# Harbor's spellings of "no network" (ours: a sandbox never has one).
NO_NETWORK = ("no-network", "none")
_WORKDIR = re.compile(r"^/[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_SYSTEM_DIRS = frozenset({"proc", "dev", "sys", "sandbox", "tmp", "logs", "tests", "solution"})


def check_keys(
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


def refuse_unsupported(
    folder: Path,
    config: dict[str, Any],
    environment: dict[str, Any],
    where: str,
    problems: list[str],
) -> None:
    env_dir = folder / "environment"
    compose = [name for name in COMPOSE_FILES if (env_dir / name).is_file()]
    if compose:
        problems.append(
            f"{where}: environment/{compose[0]} (several containers) is not supported: one "
            "sandbox per episode; give the task an environment/Dockerfile instead"
        )
    if not config.get("steps") and (folder / "steps").is_dir():
        problems.append(f"{where}: a steps/ folder without [[steps]] in {TASK_TOML}")
    if "steps" not in config and "multi_step_reward_strategy" in config:
        problems.append(f"{where}: multi_step_reward_strategy without [[steps]]")
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


def honour(
    task: dict[str, Any],
    tables: TomlTables,
    where: str,
    problems: list[str],
    warnings: list[str],
) -> None:
    """The keys that change how the episode runs, mapped onto the task or refused by name."""
    agent, verifier, environment = tables.agent, tables.verifier, tables.environment
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
        check_workdir(task, workdir, "[environment] workdir", where, problems)
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
    _env_tables(task, tables, where, problems)
    _healthcheck(task, environment.get("healthcheck"), where, problems)
    _artifacts(task, tables.config.get("artifacts"), where, problems)
    for key, why in (("build_timeout_sec", "`rollout tasks build` builds the image first"),):
        value = environment.get(key)
        if value is not None:
            _seconds(value, f"[environment] {key}", where, problems)  # still a number
            warnings.append(f"{where}: [environment] {key} = {value!r} not enforced: {why}")


def check_workdir(
    task: dict[str, Any], workdir: Any, label: str, where: str, problems: list[str]
) -> None:
    """`workdir` as the task's, or a problem naming where it came from (`label`)."""
    if (
        not isinstance(workdir, str)
        or len(workdir) > 200
        or not _WORKDIR.match(workdir)
        or any(part in (".", "..") for part in workdir.split("/"))
        or workdir.split("/")[1] in _SYSTEM_DIRS
    ):
        problems.append(
            f"{where}: {label} {workdir!r} must be an absolute path of "
            "letters, digits, '_', '.', '-', outside /proc, /dev, /sys, /tmp, /logs, "
            "/tests, /solution and /sandbox"
        )
    else:
        task["workdir"] = workdir


def _env_tables(task: dict[str, Any], tables: TomlTables, where: str, problems: list[str]) -> None:
    """[environment.env], [verifier.env], [solution.env] as the task's `env`, as written: a
    ${VAR} is resolved only where the sandbox starts (task_spec.check_task_env's rules)."""
    solution = tables.config.get("solution")
    sections = {
        "environment": tables.environment,
        "verifier": tables.verifier,
        "solution": solution if isinstance(solution, dict) else {},
    }
    env = {name: table["env"] for name, table in sections.items() if _present(table.get("env"))}
    if env:
        before = len(problems)
        check_task_env(env, f"{where}: env", problems)
        if len(problems) == before:
            task["env"] = env


# Harbor's [environment.healthcheck] keys -> the task's healthcheck fields.
HEALTHCHECK_KEYS = {
    "command": "command",
    "interval_sec": "interval_seconds",
    "timeout_sec": "timeout_seconds",
    "start_period_sec": "start_period_seconds",
    "start_interval_sec": "start_interval_seconds",
    "retries": "retries",
}


def _healthcheck(task: dict[str, Any], value: Any, where: str, problems: list[str]) -> None:
    """[environment.healthcheck] as the task's `healthcheck` (run before the agent starts), or
    refused by name: a key outside Harbor's, or a value out of task_spec's bounds."""
    if not _present(value):
        return
    label = f"{where}: [environment.healthcheck]"
    if not isinstance(value, dict):
        problems.append(f"{label} must be a table")
        return
    unknown = sorted(set(value) - set(HEALTHCHECK_KEYS))
    if unknown:
        problems.append(f"{label}: unknown keys {unknown}; Harbor's are {list(HEALTHCHECK_KEYS)}")
        return
    check = {HEALTHCHECK_KEYS[key]: item for key, item in value.items()}
    before = len(problems)
    check_healthcheck(check, label, problems)
    if len(problems) == before:
        task["healthcheck"] = check


def _artifacts(task: dict[str, Any], value: Any, where: str, problems: list[str]) -> None:
    """Top-level `artifacts` (Harbor: paths, or tables whose `source` is one) as the task's
    `artifacts`, read from the sandbox after the tests; a table's other keys (where Harbor puts
    a copy on its host, what it leaves out) are refused by name: records keep a file at its
    own path."""
    if not _present(value):
        return
    if not isinstance(value, list):
        problems.append(f"{where}: artifacts must be a list of paths")
        return
    paths = []
    for item in value:
        if isinstance(item, dict):
            other = sorted(set(item) - {"source"})
            if other:
                problems.append(
                    f"{where}: artifacts entry {item.get('source')!r}: keys {other} are not "
                    "honoured (a record keeps each file under its sandbox path)"
                )
                continue
            item = item.get("source")
        paths.append(item)
    before = len(problems)
    check_artifacts(paths, f"{where}: artifacts", problems)
    if len(problems) == before:
        task["artifacts"] = paths


def _seconds(value: Any, label: str, where: str, problems: list[str]) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        problems.append(f"{where}: {label} must be a positive number, got {value!r}")
        return 1
    return math.ceil(value)


def requirements(environment: dict[str, Any], where: str, problems: list[str]) -> dict[str, int]:
    """[environment] cpus, memory_mb and storage_mb as the task states them (unstated: nothing
    asked, the batch's limits stand)."""
    wanted: dict[str, int] = {}
    for key in ("cpus", "memory_mb", "storage_mb"):
        value = environment.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e7:
            problems.append(f"{where}: [environment] {key} must be a positive number")
            continue
        wanted[key] = math.ceil(value)
    return wanted


def time_limit(value: Any, where: str, problems: list[str]) -> int:
    if value is None:
        return DEFAULT_TASK_TIME_LIMIT_SECONDS
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        problems.append(f"{where}: [agent] timeout_sec must be a positive number, got {value!r}")
        return DEFAULT_TASK_TIME_LIMIT_SECONDS
    return math.ceil(value)

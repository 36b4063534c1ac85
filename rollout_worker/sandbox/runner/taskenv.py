"""A task's env tables in its sandbox: the host's values of its ${VAR} templates taken out of
the runner's environment, and the tables resolved for whom each is meant."""

from __future__ import annotations

import os
import re

# A task's env tables (rollout_wire.task_spec TASK_FIELDS["env"]) arrive as written; the
# host's value of each ${VAR} comes in the runner's environment as TASK_ENV_PREFIX + VAR (the
# local supervisor sets it, on Kubernetes a Secret reference), taken out of it at once: no
# process the runner starts inherits it, each gets only the tables meant for it.
TASK_ENV_PREFIX = "ROLLOUT_TASKENV_"
ENV_TEMPLATE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?\}$", re.DOTALL)


def take_host_values() -> dict:
    """{VAR: value} the backend passed for the task's templates, removed from os.environ."""
    names = [name for name in os.environ if name.startswith(TASK_ENV_PREFIX)]
    return {name[len(TASK_ENV_PREFIX) :]: os.environ.pop(name) for name in names}


def resolve_task_env(task: dict, host: dict) -> tuple[dict, list]:
    """({table: {name: value}} of the task's env with its templates resolved from `host`, the
    templates without a default whose VAR `host` lacks)."""
    tables: dict = {}
    missing: list = []
    for table, variables in (task.get("env") or {}).items():
        resolved = tables.setdefault(table, {})
        for name, text in (variables or {}).items():
            match = ENV_TEMPLATE.match(str(text))
            if match is None:
                resolved[name] = str(text)
            elif match.group(1) in host:
                resolved[name] = host[match.group(1)]
            elif match.group(2) is not None:
                resolved[name] = match.group(2)
            else:
                missing.append(f"[{table}.env] {name} = ${{{match.group(1)}}}")
    return tables, missing

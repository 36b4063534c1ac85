"""A batch's task env templates (`TASK_FIELDS["env"]`: Harbor's [environment.env],
[verifier.env], [solution.env]) on Kubernetes: pure functions, no API call.

The runner resolves a task's ${VAR} from its container's TASK_ENV_PREFIX + VAR variable
(rollout_worker/sandbox/runner/taskenv.py), which a Secret reference fills: the values live in
Secrets only, never in the ConfigMap, the receipt or a record. A Pod can reference only a
Secret of its own namespace, and each batch has a namespace of its own, so the user's Secret
(`task_env_secret`, in the workers' namespace) cannot be referenced as it is: the backend
copies the keys the tasks use into the batch's namespace as TASK_ENV_SECRET when it makes the
namespace (`batch_secret`), and each container references that copy for the tables its runner
hands on (`add_task_env`). `preflight_problems` refuses a batch before anything is created
when a ${VAR} without a default has no key to come from. The API calls are task_secret.py's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rollout_wire.task_spec import TASK_ENV_PREFIX, TASK_ENV_TABLES, env_tables_for, env_templates

# The batch namespace's copy of the keys its tasks use (made with the namespace).
TASK_ENV_SECRET = "rollout-task-env"
# pod_spec's container names (not imported: pod_spec is the one to import this module).
AGENT_CONTAINER = "agent"
CONTAINER_NAME = "episode"


def needed_keys(
    tasks: Sequence[Mapping[str, Any]], tables: Mapping[str, set[str]] | None = None
) -> dict[str, bool]:
    """{VAR: required} of the tasks' templates (in `tables[task id]` when given, else every
    table): required when one of its uses has no default (a default makes the key optional)."""
    keys: dict[str, bool] = {}
    for task in tasks:
        wanted = set(TASK_ENV_TABLES) if tables is None else tables[str(task.get("id"))]
        for table, _, var, default in env_templates(task):
            if table in wanted:
                keys[var] = keys.get(var, False) or default is None
    return keys


def container_env(
    tasks: Sequence[Mapping[str, Any]],
    tables: Mapping[str, set[str]] | None = None,
    secret: str = TASK_ENV_SECRET,
) -> list[dict[str, Any]]:
    """A container's `env` entries for the tasks' templates: each VAR from `secret`'s key of
    its name, under the runner's name for it; optional where every use has a default (the
    runner then takes the default), else the kubelet refuses to start the container."""
    return [
        {
            "name": TASK_ENV_PREFIX + var,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": var, "optional": not required}},
        }
        for var, required in sorted(needed_keys(tasks, tables).items())
    ]


def add_task_env(pod_spec: dict[str, Any], tasks: Sequence[Mapping[str, Any]]) -> None:
    """Each runner container of an episode Pod gets the templates of the tables it hands on:
    an agent's init container (grading apart) the agent's tables, the container that grades
    after it the grader's, a container doing both the two together; the stash and seed
    containers none."""
    apart = any(c["name"] == AGENT_CONTAINER for c in pod_spec.get("initContainers", []))
    roles = {
        AGENT_CONTAINER: [False],
        CONTAINER_NAME: [True] if apart else [False, True],
    }
    for container in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        name = container["name"]
        # The steps' containers (pod_steps.py): agent-2, ... act; grade-1, ... grade.
        grading = roles.get(name) or (
            [False] if name.startswith("agent-") else [True] if name.startswith("grade-") else None
        )
        if grading is None:
            continue
        tables = {
            str(task.get("id")): set().union(*(env_tables_for(task, g) for g in grading))
            for task in tasks
        }
        if grading == [False] and any(e["name"] == "ROLLOUT_STEP" for e in container["env"]):
            # A step's agent never runs tests (its grader does): no [verifier.env].
            for task in tasks:
                if task.get("steps"):
                    tables[str(task.get("id"))].discard("verifier")
        entries = container_env(tasks, tables)
        if entries:
            container["env"] = [*container.get("env", []), *entries]


def preflight_problems(
    tasks: Sequence[Mapping[str, Any]], secret_name: str | None, secret_keys: Collection[str] | None
) -> list[str]:
    """Why the batch cannot start (empty: it can), each naming the task and its key: a ${VAR}
    without a default and no Secret named, the named Secret missing (`secret_keys` None), or
    without that key."""
    if secret_name is not None and secret_keys is None:
        if any(env_templates(task) for task in tasks):
            return [f"task_env_secret {secret_name!r}: no such Secret in the workers' namespace"]
        return []
    where = (
        "name a Secret holding it: --task-env-secret / task_env_secret"
        if secret_name is None
        else f"Secret {secret_name!r} has no key of that name"
    )
    return [
        f"task {task.get('id')!r}: [{table}.env] {name} = ${{{var}}}: {where}"
        for task in tasks
        for table, name, var, default in env_templates(task)
        if default is None and (secret_keys is None or var not in secret_keys)
    ]


def batch_secret(
    tasks: Sequence[Mapping[str, Any]],
    source: Mapping[str, str],
    namespace: str,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """The batch namespace's Secret: the keys of the user's Secret (`source`, its `data` as
    the API returns it, base64) that the tasks' templates use, nothing else; None when they
    use none. `labels`: the batch's owner labels, as on everything the service creates."""
    data = {var: source[var] for var in sorted(needed_keys(tasks)) if var in source}
    if not data:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": TASK_ENV_SECRET, "namespace": namespace}
        | ({"labels": dict(labels)} if labels else {}),
        "type": "Opaque",
        "immutable": True,
        "data": data,
    }


def has_env(tasks: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a task has env tables: its batch starts cold, since a warm Pod holds no Secret
    reference and its hand-over line carries no secret (as on the local backend)."""
    return any("env" in task for task in tasks)

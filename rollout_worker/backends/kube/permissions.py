"""The Kubernetes permissions the workers need, as data: the chart's RBAC rules, its README
table and `rollout check` (SelfSubjectAccessReview, one line per permission) all come from
this one table (`tests/helm` checks that the chart and its README agree with it).

The code paths each row names are in `kube/backend.py` (and `kube/pools.py`, `kube/watch.py`);
`rollout check` (`cli/main.py`) runs `cluster_check`. The batch namespaces do not exist before a
batch starts, so their rules cannot live in a namespaced Role: they are cluster-wide grants, and
RBAC cannot narrow them to namespaces labelled `rollout.dev/owner=rollout`. The code refuses to
adopt or delete anything whose labels (and, for deletion, UIDs) do not prove it is ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLUSTER = "cluster"
BATCH_NAMESPACES = "batch namespaces"


@dataclass(frozen=True)
class Permission:
    group: str  # API group ("" is core)
    resource: str  # may name a subresource: "pods/log"
    verbs: tuple[str, ...]
    scope: str  # CLUSTER (cluster-scoped objects or all namespaces) or BATCH_NAMESPACES
    why: str  # the code path that needs it

    @property
    def api_group(self) -> str:
        return self.group or "core"


# Every rule the workers need, and nothing else.
PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        "",
        "namespaces",
        ("create", "get", "list", "delete"),
        CLUSTER,
        "start_run creates rollout-<batch> (get: adopt a redelivered one by label); "
        "delete_run reads it (UID + labels) and deletes it; list_runs (the sweeper) lists "
        "those labelled rollout.dev/owner=rollout",
    ),
    Permission(
        "",
        "nodes",
        ("list",),
        CLUSTER,
        "preflight capacity check and `rollout check` (Ready nodes, allocatable, taints)",
    ),
    Permission(
        "",
        "pods",
        ("list", "watch"),
        CLUSTER,
        "preflight lists non-terminal Pods in all namespaces (capacity); the shared Pod "
        "watch (kube/watch.py, wait_episode) lists and watches a batch's Pods; finish_run "
        "lists them for the records",
    ),
    Permission(
        "node.k8s.io",
        "runtimeclasses",
        ("get", "list"),
        CLUSTER,
        "preflight and `rollout check` read the RuntimeClass (overhead, scheduling); list "
        "names the available ones when it is missing",
    ),
    Permission(
        "",
        "configmaps",
        ("create", "get"),
        BATCH_NAMESPACES,
        "start_run creates the episode program ConfigMap (get: adopt by label)",
    ),
    Permission(
        "networking.k8s.io",
        "networkpolicies",
        ("create", "get"),
        BATCH_NAMESPACES,
        "start_run creates the deny-all NetworkPolicy (get: adopt by label)",
    ),
    Permission(
        "batch",
        "jobs",
        ("create", "get", "list", "watch", "patch"),
        BATCH_NAMESPACES,
        "start_run creates the Indexed Jobs (one per image); _settled_jobs lists/watches "
        "them; _recent_jobs and run_status list them, delete_run reads them (UID check); "
        "cancel_run suspends them",
    ),
    Permission(
        "",
        "pods/log",
        ("get",),
        BATCH_NAMESPACES,
        "read_output reads each episode Pod's log",
    ),
    Permission(
        "",
        "events",
        ("list",),
        BATCH_NAMESPACES,
        "finish_run lists the batch namespace's events for the records (events.txt)",
    ),
)

POOL_NAMESPACES = "pool namespaces"

# Only with warm pools (the chart's `rbac.warmPools`): the workers then create, claim, hand over
# to and delete Pods themselves (in rollout-pool-<key> namespaces, labelled and UID-checked as
# everything else). Without these rules a batch never finds a pool and runs cold.
POOL_PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        "",
        "pods",
        ("create", "get", "patch", "delete"),
        POOL_NAMESPACES,
        "pools.fill creates pool Pods; claim patches one (labels, deadline; "
        "resourceVersion-guarded); delete_claimed reads (UID + batch label) and deletes a "
        "batch's; drain deletes waiting ones; cancel_run shortens a claimed one's deadline",
    ),
    Permission(
        "",
        "pods/attach",
        ("create", "get"),
        POOL_NAMESPACES,
        "pools hand-over: attach to a claimed Pod's stdin and write its episode",
    ),
)

WORKERS_NAMESPACE = "workers' namespace"

# Only with Harbor env tables' ${VAR} templates on Kubernetes (the chart's `rbac.taskEnvSecret`,
# the name of the user's Secret): the workers read that one Secret in their own namespace (a
# Role limited to it by resourceNames) and copy the keys a batch uses into the batch's
# namespace (kube/task_secret.py). Without them a batch with templates is refused by name.
TASK_ENV_PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        "",
        "secrets",
        ("create",),
        BATCH_NAMESPACES,
        "start_run creates rollout-task-env, the batch's labelled copy of the keys its tasks' "
        "${VAR} templates use, once the namespace's UID is recorded (never read back)",
    ),
    Permission(
        "",
        "secrets",
        ("get",),
        WORKERS_NAMESPACE,
        "preflight and start_run read the task_env_secret a batch names (a Role in the "
        "workers' namespace, resourceNames: that Secret only)",
    ),
)

# What the workers must NOT be able to do (the tests check these with the workers' identity;
# `rollout check` reports them too, as "denied (as it should)").
MUST_NOT: tuple[tuple[str, str, str], ...] = (
    ("", "secrets", "get"),
    ("", "secrets", "list"),
    ("", "pods", "create"),  # Pods come only from the Job controller (pools: POOL_PERMISSIONS)
    ("", "pods", "delete"),
    ("", "pods/exec", "create"),
    ("", "namespaces", "update"),
    ("batch", "jobs", "delete"),
    ("rbac.authorization.k8s.io", "rolebindings", "create"),
    ("", "serviceaccounts/token", "create"),
)


def rbac_rules(warm_pools: bool = False, task_env: bool = False) -> list[dict[str, Any]]:
    """The ClusterRole's rules, in the order of PERMISSIONS (then POOL_PERMISSIONS, then the
    cluster-wide TASK_ENV_PERMISSIONS)."""
    task_env_rules = tuple(p for p in TASK_ENV_PERMISSIONS if p.scope != WORKERS_NAMESPACE)
    return [
        {"apiGroups": [p.group], "resources": [p.resource], "verbs": list(p.verbs)}
        for p in PERMISSIONS
        + (POOL_PERMISSIONS if warm_pools else ())
        + (task_env_rules if task_env else ())
    ]


def task_env_role_rules(secret: str) -> list[dict[str, Any]]:
    """The workers' namespace Role's rules: the task env Secret `secret`, and nothing else."""
    return [
        {"apiGroups": [p.group], "resources": [p.resource], "verbs": list(p.verbs)}
        | {"resourceNames": [secret]}
        for p in TASK_ENV_PERMISSIONS
        if p.scope == WORKERS_NAMESPACE
    ]


def markdown_table() -> str:
    lines = [
        "| API group | resource | verbs | scope | needed by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in PERMISSIONS + POOL_PERMISSIONS + TASK_ENV_PERMISSIONS:
        lines.append(
            f"| {p.api_group} | {p.resource} | {', '.join(p.verbs)} | {p.scope} | {p.why} |"
        )
    return "\n".join(lines)


def _review(authz: Any, group: str, resource: str, verb: str) -> tuple[bool, str]:
    resource, _, subresource = resource.partition("/")
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        # namespace "" = all namespaces: the batch namespaces do not exist yet.
        "spec": {
            "resourceAttributes": {
                "group": group,
                "resource": resource,
                "subresource": subresource,
                "verb": verb,
                "namespace": "",
            }
        },
    }
    status = authz.create_self_subject_access_review(body).status
    return bool(status.allowed), status.reason or status.evaluation_error or ""


def access_review(api_client: Any) -> tuple[list[str], list[str]]:
    """SelfSubjectAccessReview of every permission, with the caller's own identity.

    Returns (lines, problems): one line per (resource, verb), `granted` or `denied`, then one
    per MUST_NOT entry. A needed permission denied is a problem; one the workers never need but
    hold is only reported (an admin's kubeconfig holds them all).
    """
    from kubernetes import client

    authz = client.AuthorizationV1Api(api_client)
    lines, problems = [], []
    for p in PERMISSIONS:
        for verb in p.verbs:
            allowed, reason = _review(authz, p.group, p.resource, verb)
            what = f"{verb} {p.api_group}/{p.resource} ({p.scope})"
            lines.append(f"permission {what}: {'granted' if allowed else 'denied'}")
            if not allowed:
                problems.append(f"permission {what} denied{f': {reason}' if reason else ''}")
    for p in POOL_PERMISSIONS:
        for verb in p.verbs:
            allowed, _ = _review(authz, p.group, p.resource, verb)
            what = f"{verb} {p.api_group}/{p.resource} ({p.scope})"
            verdict = "granted" if allowed else "denied (batches run cold)"
            lines.append(f"warm pools {what}: {verdict}")
    for p in TASK_ENV_PERMISSIONS:
        if p.scope == WORKERS_NAMESPACE:
            # Limited to one Secret's name, which only a batch names: its preflight asks then
            # (a 403 names the Secret and the namespace).
            continue
        for verb in p.verbs:
            allowed, _ = _review(authz, p.group, p.resource, verb)
            what = f"{verb} {p.api_group}/{p.resource} ({p.scope})"
            verdict = "granted" if allowed else "denied (${VAR} templates refused)"
            lines.append(f"task env {what}: {verdict}")
    for group, resource, verb in MUST_NOT:
        allowed, _ = _review(authz, group, resource, verb)
        what = f"{verb} {group or 'core'}/{resource}"
        lines.append(f"not needed {what}: {'granted (more than needed)' if allowed else 'denied'}")
    return lines, problems


def cluster_check(backend: Any, runtime: str) -> tuple[list[str], list[str]]:
    """`rollout check` on a cluster: the backend's own check (cluster, nodes, RuntimeClass),
    then the access review; (lines, problems). Never raises for an unusable cluster."""
    from rollout_wire.errors import RolloutError
    from rollout_worker.backends.kube.check import check

    try:
        lines, problems = check(backend, runtime)
    except RolloutError as exc:
        lines, problems = [], [f"cluster not usable: {exc}"]
    try:
        review, denied = access_review(backend.api)
    except Exception as exc:  # ApiException, connection errors: report, do not crash check
        review, denied = [], [f"SelfSubjectAccessReview failed: {type(exc).__name__}: {exc}"]
    return lines + review, problems + denied


if __name__ == "__main__":
    print(markdown_table())

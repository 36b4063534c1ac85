"""kube/permissions.py without a cluster: the access review's lines and verdicts."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_worker.backends.kube import permissions


class FakeAuthz:
    def __init__(self, granted: set[tuple[str, str, str]]) -> None:
        self.granted = granted
        self.asked: list[dict] = []

    def create_self_subject_access_review(self, body):
        attrs = body["spec"]["resourceAttributes"]
        self.asked.append(attrs)
        resource = attrs["resource"] + (f"/{attrs['subresource']}" if attrs["subresource"] else "")
        allowed = (attrs["group"], resource, attrs["verb"]) in self.granted
        return SimpleNamespace(
            status=SimpleNamespace(allowed=allowed, reason="", evaluation_error="")
        )


def review(monkeypatch, granted):
    fake = FakeAuthz(granted)
    monkeypatch.setattr("kubernetes.client.AuthorizationV1Api", lambda api: fake)
    return fake, permissions.access_review(object())


NEEDED = {(p.group, p.resource, v) for p in permissions.PERMISSIONS for v in p.verbs}


def test_all_granted_is_one_line_per_permission(monkeypatch):
    fake, (lines, problems) = review(monkeypatch, NEEDED)
    assert problems == []
    pool_verbs = sum(len(p.verbs) for p in permissions.POOL_PERMISSIONS)
    # The task env Secret's get is limited to a name only a batch gives: not asked here.
    task_env_verbs = 1
    assert len(lines) == len(NEEDED) + pool_verbs + task_env_verbs + len(permissions.MUST_NOT)
    assert (
        "task env create core/secrets (batch namespaces): denied (${VAR} templates refused)"
        in lines
    )
    # Warm pools are optional: denied, they are a line, not a problem.
    assert (
        "warm pools create core/pods/attach (pool namespaces): denied (batches run cold)" in lines
    )
    assert "permission get core/pods/log (batch namespaces): granted" in lines
    assert "not needed get core/secrets: denied" in lines
    # Asked for all namespaces (the batch namespaces do not exist yet), subresources split.
    assert all(a["namespace"] == "" for a in fake.asked)
    assert {"resource": "pods", "subresource": "log"}.items() <= next(
        a for a in fake.asked if a["subresource"] == "log"
    ).items()


def test_a_missing_permission_is_a_problem_an_extra_one_only_a_line(monkeypatch):
    granted = (NEEDED - {("batch", "jobs", "create")}) | {("", "secrets", "get")}
    _, (lines, problems) = review(monkeypatch, granted)
    assert problems == ["permission create batch/jobs (batch namespaces) denied"]
    assert "not needed get core/secrets: granted (more than needed)" in lines


def test_rules_and_table_cover_the_same_permissions():
    rules = permissions.rbac_rules()
    assert len(rules) == len(permissions.PERMISSIONS)
    every = permissions.PERMISSIONS + permissions.POOL_PERMISSIONS
    assert len(permissions.rbac_rules(warm_pools=True)) == len(every)
    table = permissions.markdown_table().splitlines()
    assert len(table) == 2 + len(every) + len(permissions.TASK_ENV_PERMISSIONS)
    assert not NEEDED & set(permissions.MUST_NOT)
    # Task env: create cluster-wide, get only of the one named Secret (never all of them).
    assert permissions.rbac_rules(task_env=True)[len(rules) :] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}
    ]
    assert permissions.task_env_role_rules("keys") == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["keys"]}
    ]

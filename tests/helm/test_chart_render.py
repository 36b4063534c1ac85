"""The chart as rendered by helm (no cluster): RBAC equals the permission table, the README's
table is the generated one, and the values do what values.yaml says."""

from __future__ import annotations

import re

import pytest

from rollout_worker.backends.kube import permissions
from rollout_worker.celery_app import COLLECT_LISTS
from tests.helm.conftest import CHART, run_helm

pytestmark = pytest.mark.helm


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def test_lint(helm):
    run_helm(helm, "lint", "--strict", str(CHART))
    run_helm(
        helm,
        "lint",
        "--strict",
        str(CHART),
        "--set",
        "redis.enabled=false,externalRedis.url=rediss://:pw@redis.example:6380/0,keda.enabled=true,"
        "flower.enabled=true",
    )


def test_rbac_is_exactly_the_permission_table(render):
    objects = render()
    role = one(objects, "ClusterRole")
    assert role["rules"] == permissions.rbac_rules()
    # Nothing namespaced, nothing else cluster-scoped: one ClusterRole, bound to our SA only.
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-rollout", "namespace": "rollout"}
    ]
    granted = {(r["apiGroups"][0], r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    for forbidden in permissions.MUST_NOT:
        assert forbidden not in granted
    # No wildcard anywhere.
    assert all("*" not in r["verbs"] + r["resources"] + r["apiGroups"] for r in role["rules"])


def test_warm_pools_add_exactly_the_pool_permissions(render):
    role = one(render("rbac.warmPools=true"), "ClusterRole")
    assert role["rules"] == permissions.rbac_rules(warm_pools=True)
    assert role["rules"][: len(permissions.PERMISSIONS)] == permissions.rbac_rules()


def test_a_task_env_secret_adds_secret_create_and_a_role_for_that_secret_only(render):
    objects = render("rbac.taskEnvSecret=task-keys")
    role = one(objects, "ClusterRole")
    assert role["rules"] == permissions.rbac_rules(task_env=True)
    named = one(objects, "Role")
    assert named["metadata"]["namespace"] == "rollout"
    assert named["rules"] == permissions.task_env_role_rules("task-keys")
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": named["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-rollout", "namespace": "rollout"}
    ]


def test_readme_table_is_the_generated_one():
    text = (CHART / "README.md").read_text()
    block = re.search(r"<!-- permissions:start -->\n(.*?)\n<!-- permissions:end -->", text, re.S)
    assert block, "README.md lost its permissions markers"
    assert block.group(1) == permissions.markdown_table()


def test_rbac_rule_comments_name_code_paths():
    text = (CHART / "templates" / "rbac.yaml").read_text()
    rules = text.split("rules:", 1)[1].split("---", 1)[0]
    # Each rule is preceded by a comment naming the function that needs it.
    chunks = re.split(r"\n  - apiGroups", rules)
    for chunk in chunks[:-1]:
        comment = chunk.strip().splitlines()[-1]
        assert comment.lstrip().startswith("#"), chunk


def test_workers_defaults(render):
    objects = render()
    control = one(objects, "Deployment", "rel-rollout-control")
    collect = one(objects, "Deployment", "rel-rollout-collect")
    assert control["spec"]["replicas"] == 1 and collect["spec"]["replicas"] == 2
    for deploy, queue, pool, conc, grace in (
        (control, "control", "prefork", 2, 120),
        (collect, "collect", "threads", 16, 60),
    ):
        pod = deploy["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "rel-rollout"
        assert pod["terminationGracePeriodSeconds"] == grace
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        assert container["command"] == ["rollout", "worker"]
        assert f"--queues={queue}" in container["args"]
        assert f"--pool={pool}" in container["args"]
        assert f"--concurrency={conc}" in container["args"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        env = {e["name"]: e for e in container["env"]}
        assert (
            env["ROLLOUT_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "rel-rollout-redis-url"
        )
    secret = one(objects, "Secret", "rel-rollout-redis-url")
    assert secret["stringData"]["url"] == "redis://rel-rollout-redis:6379/0"
    redis = one(objects, "StatefulSet", "rel-rollout-redis")
    assert "--appendonly" in redis["spec"]["template"]["spec"]["containers"][0]["command"]
    assert (
        redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        == "1Gi"
    )
    assert redis["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not by_kind(objects, "ScaledObject")
    assert not [o for o in objects if o["metadata"]["name"].endswith("-flower")]
    hook = one(objects, "Pod")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert hook["spec"]["containers"][0]["command"][:3] == ["rollout", "check", "--kubernetes"]


def test_one_sweeper_runs_the_beat(render):
    objects = render("control.replicas=3")
    sweeper = one(objects, "Deployment", "rel-rollout-sweeper")
    assert sweeper["spec"]["replicas"] == 1
    assert sweeper["spec"]["strategy"] == {"type": "Recreate"}
    args = sweeper["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--beat" in args and "--queues=control" in args
    control = one(objects, "Deployment", "rel-rollout-control")
    assert control["spec"]["replicas"] == 3
    assert "--beat" not in control["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [
        o for o in render("sweeper.enabled=false") if o["metadata"]["name"].endswith("sweeper")
    ]


def test_collectors_scale_by_one_value(render):
    collect = one(render("collect.replicas=7"), "Deployment", "rel-rollout-collect")
    assert collect["spec"]["replicas"] == 7


def test_keda_replaces_the_replica_count(render):
    objects = render("keda.enabled=true", "keda.maxReplicaCount=20")
    scaled = one(objects, "ScaledObject")
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis"}
    # Every list kombu keeps for the collect queue's priorities (the first collect messages
    # of a batch wait in the last one).
    assert [t["metadata"]["listName"] for t in triggers] == list(COLLECT_LISTS)
    assert {t["metadata"]["address"] for t in triggers} == {"rel-rollout-redis.rollout.svc:6379"}
    assert scaled["spec"]["maxReplicaCount"] == 20
    assert "replicas" not in one(objects, "Deployment", "rel-rollout-collect")["spec"]


def test_external_redis_through_a_secret(render):
    objects = render(
        "redis.enabled=false",
        "externalRedis.existingSecret=my-redis",
        "externalRedis.existingSecretKey=uri",
        "externalRedis.tls.caSecret=redis-ca",
    )
    assert not by_kind(objects, "StatefulSet") and not by_kind(objects, "Secret")
    pod = one(objects, "Deployment", "rel-rollout-collect")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["ROLLOUT_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "my-redis",
        "key": "uri",
    }
    assert {"name": "redis-tls", "secret": {"secretName": "redis-ca"}} in pod["volumes"]
    inline = render("redis.enabled=false", "externalRedis.url=rediss://:pw@r.example:6380/0")
    assert one(inline, "Secret")["stringData"]["url"] == "rediss://:pw@r.example:6380/0"


def test_flower_and_host_network(render):
    objects = render(
        "flower.enabled=true",
        "hostNetwork=true",
        "redis.port=16399",
        "kubernetesApi.host=127.0.0.1",
        "kubernetesApi.port=6443",
    )
    flower = one(objects, "Deployment", "rel-rollout-flower")
    assert flower["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert one(objects, "Secret")["stringData"]["url"] == "redis://127.0.0.1:16399/0"
    control = one(objects, "Deployment", "rel-rollout-control")["spec"]["template"]["spec"]
    assert control["hostNetwork"] is True
    env = {e["name"]: e.get("value") for e in control["containers"][0]["env"]}
    assert (
        env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    )
    assert "--events" in control["containers"][0]["args"]

"""Harbor's env tables on the local cluster's real node, the Kubernetes twin of
test_harbor_env.py: the ${VAR} templates take their values from a Secret the user names
(`task_env_secret`, in the workers' namespace), copied into the batch's namespace and
referenced by each container for the tables its runner hands on. The oracle scores 1 only when
the agent saw [environment.env] + [solution.env] and the tests [environment.env] +
[verifier.env]; no value (raw or base64) is in the ConfigMap, a Pod or Job spec, the records or
Redis. A key the Secret lacks refuses the batch by name before anything is created."""

from __future__ import annotations

import base64
import time
import uuid

import pytest
import redis
from kubernetes.client.rest import ApiException

from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.kube import api
from rollout_worker.backends.kube.objects import namespace_name
from rollout_worker.settings import Settings
from tests.integration.test_harbor_env import JUDGE, SHOWN, SOLVE, TOML, env_task
from tests.integration.test_red_team import NEVER_ASKED
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

VALUES = {"ROLLOUT_TEST_SHOWN": SHOWN, "ROLLOUT_TEST_JUDGE": JUDGE}
# Every form a value could leak in: as written, and as a Secret's data holds it.
FORMS = [v.encode() for v in VALUES.values()] + [
    base64.b64encode(v.encode()) for v in VALUES.values()
]


def kube_task(tmp_path):
    """test_harbor_env's task, its oracle reading the tasks file where a Pod mounts it."""
    (task,) = load_task_set(str(env_task(tmp_path / "tasks")))
    solve = SOLVE.replace("/sandbox/tasks.json", "/demo/tasks.json")
    assert "${ROLLOUT_TEST_JUDGE}" in TOML and solve != SOLVE
    return task | {"agent": "oracle", "solution": {"solve.sh": solve}}


def user_secret(k8s_cluster, data):
    """The user's Secret in the workers' namespace (labelled as a test's; deleted by its UID)."""
    namespace = api.workers_namespace(Settings(kubeconfig=str(k8s_cluster.kubeconfig)))
    body = {
        "metadata": {
            "name": f"task-env-{uuid.uuid4().hex[:8]}",
            "labels": {"rollout.dev/test": "true"},
        },
        "stringData": data,
    }
    made = k8s_cluster.core.create_namespaced_secret(namespace, body)
    return namespace, made.metadata.name, made.metadata.uid


def delete_secret(k8s_cluster, namespace, name, uid):
    k8s_cluster.core.delete_namespaced_secret(name, namespace, body={"preconditions": {"uid": uid}})


def submit(real_node, real_stack, task, secret):
    client = RolloutClient(real_stack.redis_url)
    batch = client.submit(
        **real_node.batch_fields(),
        backend="kubernetes",
        tasks=[task],
        samples_per_task=1,
        policy=NEVER_ASKED,
        capacity_check="warn",
        task_env_secret=secret,
    )
    return client, batch


def batch_objects(k8s_cluster, namespace, timeout=120):
    """The batch namespace's ConfigMap and task env Secret, read as soon as both exist."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            configmap = k8s_cluster.core.read_namespaced_config_map("episode", namespace)
            secret = k8s_cluster.core.read_namespaced_secret("rollout-task-env", namespace)
            return configmap, secret
        except ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def redis_bytes(url):
    """Every key and value in Redis, as one byte string."""
    r = redis.Redis.from_url(url)
    out = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        out.append(key)
        if kind == "string":
            out.append(r.get(key) or b"")
        elif kind == "hash":
            out.extend(b"%s=%s" % kv for kv in r.hgetall(key).items())
        elif kind == "list":
            out.extend(r.lrange(key, 0, -1))
        elif kind == "set":
            out.extend(r.smembers(key))
        elif kind == "zset":
            out.extend(r.zrange(key, 0, -1))
        elif kind == "stream":
            for _, fields in r.xrange(key):
                out.extend(b"%s=%s" % kv for kv in fields.items())
    r.close()
    return b"\n".join(out)


def test_each_container_sees_its_env_tables_from_the_named_secret(
    real_node, real_stack, k8s_cluster, tmp_path
):
    task = kube_task(tmp_path)
    namespace, name, uid = user_secret(k8s_cluster, VALUES | {"UNRELATED": "not-copied"})
    try:
        client, batch = submit(real_node, real_stack, task, name)
        try:
            configmap, copy = batch_objects(k8s_cluster, namespace_name(batch.batch_id))
            report = client.wait(batch.batch_id, timeout=600)
            deadline = time.monotonic() + 60  # the records are saved after the report
            while client.receipt(batch.batch_id).get("records") != "complete":
                assert time.monotonic() < deadline, client.receipt(batch.batch_id)
                time.sleep(0.2)
            records = client.records(batch.batch_id)
            logs = client.logs(batch.batch_id)
        finally:
            client.close()
    finally:
        delete_secret(k8s_cluster, namespace, name, uid)
    (row,) = report["pods"]
    assert row["reward"] == 1, (row["errors"], row["tests_output"], row["agent_output"])
    # The copy: only the keys the task uses, labelled as the batch's objects.
    assert sorted(copy.data) == ["ROLLOUT_TEST_JUDGE", "ROLLOUT_TEST_SHOWN"]
    assert copy.metadata.labels["rollout.dev/batch"] == batch.batch_id
    assert copy.metadata.labels["rollout.dev/owner"] == "rollout"
    # The ConfigMap holds the templates as written, the agent's file without [verifier.env].
    assert "${ROLLOUT_TEST_JUDGE}" in configmap.data["tasks.json"]
    assert "ROLLOUT_TEST_JUDGE" not in configmap.data["tasks-agent.json"]
    places = {
        "configmap": str(configmap.data).encode(),
        "redis": redis_bytes(real_stack.redis_url),
        **{f"record {n}": text.encode() for n, text in records.items()},
        **{f"log {i}": text.encode() for i, text in logs.items()},
    }
    assert "pods.json" in records and "job.json" in records
    assert b"secretKeyRef" in places["record pods.json"]
    for where, data in places.items():
        for form in FORMS:
            assert form not in data, (where, form)


def test_a_key_the_secret_lacks_refuses_the_batch_by_name_before_anything_is_made(
    real_node, real_stack, k8s_cluster, tmp_path
):
    task = kube_task(tmp_path)
    namespace, name, uid = user_secret(k8s_cluster, {"ROLLOUT_TEST_SHOWN": SHOWN})
    try:
        client, batch = submit(real_node, real_stack, task, name)
        try:
            report = client.wait(batch.batch_id, timeout=120)
        finally:
            client.close()
    finally:
        delete_secret(k8s_cluster, namespace, name, uid)
    said = str(report)
    assert report["status"] == "error" and not report.get("pods"), report
    assert (
        f"task 'env-tables': [verifier.env] JUDGE = ${{ROLLOUT_TEST_JUDGE}}: Secret {name!r} "
        "has no key of that name" in said
    ), said
    with pytest.raises(ApiException) as gone:
        k8s_cluster.core.read_namespace(namespace_name(batch.batch_id))
    assert gone.value.status == 404
    for form in FORMS:
        assert form not in said.encode()

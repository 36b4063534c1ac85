"""Episodes really run: the guide's Job, built by rollout_worker.backends.kube.objects, on the local
cluster's real node (kubelet + containerd + runc, images built locally, no registry).

Each episode's `ready`/`reward` lines are read through the API server (kubelet logs) and
validated with the guide's rules (rollout_worker.validation.validate_episode).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from datetime import datetime

import pytest
from kubernetes import client as k8s_client
from kubernetes.client.rest import ApiException

from rollout_wire.request import parse_spec
from rollout_wire.rows import EpisodeRow
from rollout_worker.backends.kube import objects
from rollout_worker.backends.kube.pod_spec import CONTAINER_NAME
from rollout_worker.metrics import percentile
from rollout_worker.observation import EpisodeObservation
from rollout_worker.sandbox import episode_program_text
from rollout_worker.validation import validate_episode

from . import cluster as kc

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real]

JOB_TIMEOUT_S = 300


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


@contextlib.contextmanager
def _batch_namespace(cluster: kc.Cluster, spec):
    """The batch's namespace (objects.namespace_manifest + the test label), deleted after."""
    body = objects.namespace_manifest(spec)
    body["metadata"]["labels"][kc.TEST_NAMESPACE_LABEL] = "true"
    cluster.core.create_namespace(body)
    name = body["metadata"]["name"]
    try:
        kc.wait_for(
            lambda: kc._exists(
                lambda: cluster.core.read_namespaced_service_account("default", name)
            ),
            60,
            f"default ServiceAccount in {name}",
        )
        yield name
    finally:
        kc.delete_namespace(cluster, name)


def _spec(node: kc.RealNode, *, count: int, parallelism: int, **extra):
    return parse_spec(
        {
            "batch_id": f"real-{uuid.uuid4().hex[:10]}",
            "count": count,
            "parallelism": parallelism,
            "backend": "kubernetes",
            **node.batch_fields(),
            **extra,
        },
        max_episodes=count,
    )


def _wait_job(cluster: kc.Cluster, namespace: str, name: str, timeout: float):
    def finished():
        status = cluster.batch.read_namespaced_job_status(name, namespace).status
        for cond in status.conditions or []:
            if cond.status == "True" and cond.type in ("Complete", "Failed"):
                return status
        return None

    return kc.wait_for(finished, timeout, f"Job {namespace}/{name} to finish", interval=0.5)


def _observe(pod) -> EpisodeObservation:
    status = pod.status
    container = next(c for c in status.container_statuses or [] if c.name == "episode")
    terminated = container.state.terminated if container.state else None
    index = int(pod.metadata.labels[objects.INDEX_LABEL])
    return EpisodeObservation(
        index=index,
        episode_id=pod.metadata.name,
        phase=status.phase,
        created_at=_ts(pod.metadata.creation_timestamp),
        started_at=_ts(terminated.started_at) if terminated else None,
        finished_at=_ts(terminated.finished_at) if terminated else None,
        node=pod.spec.node_name,
        image_id=container.image_id or None,
        exit_code=terminated.exit_code if terminated else None,
        restart_count=container.restart_count,
        reason=(terminated.reason if terminated else None) or status.reason,
        termination_message=(terminated.message if terminated else None) or None,
        timing={"container_started_at": _ts(terminated.started_at) if terminated else None},
    )


def _describe_failure(cluster: kc.Cluster, namespace: str) -> str:
    lines = []
    for pod in cluster.core.list_namespaced_pod(namespace).items:
        lines.append(f"pod {pod.metadata.name}: {pod.status.phase} {pod.status.reason or ''}")
        for c in pod.status.container_statuses or []:
            lines.append(f"  {c.name}: {c.state}")
    for ev in cluster.core.list_namespaced_event(namespace).items[-30:]:
        lines.append(f"event {ev.involved_object.name}: {ev.reason}: {ev.message}")
    return "\n".join(lines)


def run_batch_on_real_node(
    cluster: kc.Cluster, node: kc.RealNode, *, count: int, parallelism: int
) -> dict:
    """Create the batch's objects exactly as the Kubernetes backend does, wait for the Job,
    validate every episode from its Pod and its log read through the API server."""
    spec = _spec(node, count=count, parallelism=parallelism)
    job_body = objects.job_manifest(spec, ttl_seconds_after_finished=600)
    pod_spec = job_body["spec"]["template"]["spec"]
    # The guide's shape, placed on the real node.
    assert pod_spec["runtimeClassName"] == node.runtime_class
    assert pod_spec["nodeSelector"] == node.node_selector
    assert pod_spec["securityContext"]["runAsUser"] == 1000
    assert pod_spec["containers"][0]["command"] == ["python", "-B", "/demo/episode.py"]

    with _batch_namespace(cluster, spec) as namespace:
        cluster.core.create_namespaced_config_map(
            namespace, objects.configmap_manifest(spec, episode_program_text())
        )
        k8s_client.NetworkingV1Api(cluster.api_client).create_namespaced_network_policy(
            namespace, objects.network_policy_manifest(spec)
        )
        t_submit = time.time()
        job = cluster.batch.create_namespaced_job(namespace, job_body)
        origin = _ts(job.metadata.creation_timestamp)
        try:
            status = _wait_job(cluster, namespace, objects.JOB_NAME, JOB_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"Job did not finish:\n{_describe_failure(cluster, namespace)}")
        t_complete = time.time()
        complete = any(c.type == "Complete" and c.status == "True" for c in status.conditions)
        assert complete, f"Job failed: {status}\n{_describe_failure(cluster, namespace)}"
        assert status.succeeded == count

        pods = cluster.core.list_namespaced_pod(
            namespace, label_selector=f"batch.kubernetes.io/job-name={objects.JOB_NAME}"
        ).items
        assert len(pods) == count, [p.metadata.name for p in pods]
        rows: list[EpisodeRow] = []
        for pod in pods:
            log = cluster.core.read_namespaced_pod_log(
                pod.metadata.name, namespace, container=CONTAINER_NAME
            )
            rows.append(validate_episode(_observe(pod), log, origin))

    failed = {r.pod: r.errors for r in rows if not r.ok}
    assert not failed, json.dumps(failed, indent=1)
    assert sorted(r.index for r in rows) == list(range(count))
    assert {r.node for r in rows} == {node.name}
    assert all(r.reward == 1 for r in rows)
    assert all(r.image_id for r in rows)
    startup = [r.pod_to_ready_seconds for r in rows if r.pod_to_ready_seconds is not None]
    result = {
        "episodes": count,
        "parallelism": parallelism,
        "pod_to_ready_p50": percentile(startup, 0.5),
        "pod_to_ready_p95": percentile(startup, 0.95),
        "pod_to_ready_max": max(startup),
        "batch_to_all_ready": max(r.ready_at for r in rows if r.ready_at) - origin,
        "batch_to_all_rewards": max(r.reward_at for r in rows if r.reward_at) - origin,
        "client_job_complete": t_complete - t_submit,
        "runtime_init_p50": percentile(
            [r.timing["runtime_init_seconds"] for r in rows if "runtime_init_seconds" in r.timing],
            0.5,
        ),
    }
    print(f"\nreal node {node.name}: " + json.dumps({k: round(v, 3) for k, v in result.items()}))
    return result


def test_node_is_real_and_kwok_leaves_it_alone(k8s_cluster, real_node):
    node = k8s_cluster.core.read_node(real_node.name)
    info = node.status.node_info
    assert info.container_runtime_version.startswith("containerd://")
    assert info.kubelet_version == kc.pinned_versions()["K8S_VERSION"]
    assert node.metadata.labels[kc.REAL_NODE_LABEL_KEY] == kc.REAL_NODE_LABEL_VALUE
    # KWOK manages only type=kwok nodes: no fake-node annotation or label on this one.
    assert "kwok.x-k8s.io/node" not in (node.metadata.annotations or {})
    assert node.metadata.labels.get("type") != "kwok"
    taints = {(t.key, t.effect) for t in node.spec.taints or []}
    assert (kc.REAL_NODE_LABEL_KEY, "NoSchedule") in taints

    # The kubelet holds the node's lease (KWOK, managing only type=kwok nodes, never takes it).
    def lease_holder():
        lease = k8s_client.CoordinationV1Api(k8s_cluster.api_client).read_namespaced_lease(
            real_node.name, "kube-node-lease"
        )
        return lease.spec.holder_identity

    assert kc.wait_for(lease_holder, 30, f"lease of {real_node.name}") == real_node.name
    rc = k8s_client.NodeV1Api(k8s_cluster.api_client).read_runtime_class(real_node.runtime_class)
    assert rc.handler == "runc"
    if real_node.start_seconds is not None:
        print(f"\nreal node started in {real_node.start_seconds:.1f}s")


def test_guide_job_ten_parallel_episodes_complete(k8s_cluster, real_node):
    result = run_batch_on_real_node(k8s_cluster, real_node, count=10, parallelism=10)
    assert result["pod_to_ready_p95"] < 60


def test_guide_job_sequential_episodes_complete(k8s_cluster, real_node):
    run_batch_on_real_node(k8s_cluster, real_node, count=10, parallelism=1)


def _runtime_class(cluster: kc.Cluster, name: str, overhead: dict | None = None) -> None:
    body: dict = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": name, "labels": {kc.TEST_NAMESPACE_LABEL: "true"}},
        "handler": "runc",
    }
    if overhead:
        body["overhead"] = {"podFixed": overhead}
    k8s_client.NodeV1Api(cluster.api_client).create_runtime_class(body)


def _delete_runtime_class(cluster: kc.Cluster, name: str) -> None:
    with contextlib.suppress(ApiException):
        k8s_client.NodeV1Api(cluster.api_client).delete_runtime_class(name)


def test_sandbox_runs_confined_as_uid_1000(k8s_cluster, k8s_namespace, real_node):
    """The Job's Pod template really confines the process: uid/gid 1000, no capabilities,
    seccomp filter on, read-only root, writable /tmp and /workspace, HOME unset or unused."""
    spec = _spec(real_node, count=1, parallelism=1)
    template = objects.job_manifest(spec, ttl_seconds_after_finished=60)["spec"]["template"]
    pod_spec = template["spec"]
    probe = (
        "import json, os\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in l)\n"
        "def writable(p):\n"
        "    try:\n"
        "        open(os.path.join(p, '.probe'), 'w').close(); return True\n"
        "    except OSError:\n"
        "        return False\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'cap_eff': status['CapEff'],"
        " 'seccomp': status['Seccomp'], 'nnp': status['NoNewPrivs'], 'root_rw': writable('/'),"
        " 'tmp_rw': writable('/tmp'), 'ws_rw': writable('/workspace'),"
        " 'episode': os.environ.get('EPISODE_ID')}))\n"
    )
    container = pod_spec["containers"][0]
    container["command"] = ["python", "-B", "-c", probe]
    pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != "program"]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "program"]
    name = "probe"
    k8s_cluster.core.create_namespaced_pod(
        k8s_namespace,
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": pod_spec},
    )

    def done():
        pod = k8s_cluster.core.read_namespaced_pod_status(name, k8s_namespace)
        return pod if pod.status.phase in ("Succeeded", "Failed") else None

    pod = kc.wait_for(done, 120, f"Pod {name} to finish", interval=0.5)
    log = k8s_cluster.core.read_namespaced_pod_log(name, k8s_namespace)
    assert pod.status.phase == "Succeeded", log
    facts = json.loads(log.strip().splitlines()[-1])
    assert facts == {
        "uid": 1000,
        "gid": 1000,
        "cap_eff": "0000000000000000",
        "seccomp": "2",
        "nnp": "1",
        "root_rw": False,
        "tmp_rw": True,
        "ws_rw": True,
        "episode": name,
    }


def test_runtime_class_overhead_is_applied(k8s_cluster, k8s_namespace, real_node):
    """A `cube`-like RuntimeClass with a Pod overhead (handler runc): admission adds the overhead
    to the Pod, the scheduler counts it, and the Pod still runs on the real node."""
    rc_name = f"cube-{uuid.uuid4().hex[:6]}"
    _runtime_class(k8s_cluster, rc_name, overhead={"cpu": "50m", "memory": "768Mi"})
    try:
        spec = _spec(real_node, count=1, parallelism=1, runtime=rc_name)
        template = objects.job_manifest(spec, ttl_seconds_after_finished=60)["spec"]["template"]
        pod_spec = template["spec"]
        container = pod_spec["containers"][0]
        container["command"] = ["python", "-B", "-c", "print('ok')"]
        pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != "program"]
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "program"]
        k8s_cluster.core.create_namespaced_pod(
            k8s_namespace,
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cube"}, "spec": pod_spec},
        )

        def done():
            pod = k8s_cluster.core.read_namespaced_pod_status("cube", k8s_namespace)
            return pod if pod.status.phase in ("Succeeded", "Failed") else None

        pod = kc.wait_for(done, 120, "Pod cube to finish", interval=0.5)
        assert pod.status.phase == "Succeeded"
        assert pod.spec.overhead == {"cpu": "50m", "memory": "768Mi"}
        assert pod.spec.node_name == real_node.name
    finally:
        _delete_runtime_class(k8s_cluster, rc_name)

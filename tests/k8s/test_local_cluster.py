"""The local Kubernetes (hack/localkube) works for what the project needs from it:
the pinned control plane, Jobs at scale on KWOK nodes, and Pod logs through the API server."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from . import cluster as kc

pytestmark = pytest.mark.k8s

JOB_COMPLETIONS = 1000
JOB_PARALLELISM = 200


def _pod_template(labels: dict[str, str]) -> dict:
    return {
        "metadata": {"labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                # Never pulled or run: KWOK simulates the container.
                {"name": "main", "image": "rollout.invalid/noop:1", "command": ["true"]}
            ],
            **kc.kwok_placement(),
        },
    }


def test_version_reports_pinned_release(local_k8s_cluster):
    """Checks the locally built control plane (marker k8s_local, from the fixture): with
    KUBECONFIG pointing at another cluster it fails unless left out by request."""
    pinned = kc.pinned_versions()["K8S_VERSION"]
    info = local_k8s_cluster.version()
    assert info.git_version == pinned
    major, minor = pinned.lstrip("v").split(".")[:2]
    assert (info.major, info.minor) == (major, minor)
    assert info.git_tree_state == "clean"


def test_job_with_1000_completions_on_kwok_nodes(k8s_cluster, k8s_namespace, kwok_nodes):
    """An Indexed Job (the shape a batch runs as) of 1000 completions at parallelism 200 runs
    to completion on KWOK nodes, every index once.

    The Job's status is what Kubernetes promises, not its Pods: the Job controller counts a Pod
    before it goes (Job tracking with finalizers), and may delete one it saw as surplus while it
    was succeeding (a cold CI once listed 996 Pods of a Job counted 1000 succeeded)."""
    name = "burst"
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completions": JOB_COMPLETIONS,
            "parallelism": JOB_PARALLELISM,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": _pod_template({"app": name}),
        },
    }
    t0 = time.monotonic()
    k8s_cluster.batch.create_namespaced_job(k8s_namespace, job)

    def complete():
        status = k8s_cluster.batch.read_namespaced_job_status(name, k8s_namespace).status
        for cond in status.conditions or []:
            if cond.type == "Failed" and cond.status == "True":
                pytest.fail(f"Job failed: {cond.reason}: {cond.message}")
            if cond.type == "Complete" and cond.status == "True":
                return status
        return None

    status = kc.wait_for(complete, 300, f"Job {name} to complete", interval=1)
    elapsed = time.monotonic() - t0
    assert status.succeeded == JOB_COMPLETIONS
    assert status.completed_indexes == f"0-{JOB_COMPLETIONS - 1}"
    assert not status.failed

    # The Pods left ran on KWOK nodes and ended well (raw JSON: 1000 Pods into models is slow).
    resp = k8s_cluster.core.list_namespaced_pod(
        k8s_namespace,
        label_selector=f"batch.kubernetes.io/job-name={name}",
        _preload_content=False,
    )
    pods = json.loads(resp.data)["items"]
    phases: dict[str, int] = {}
    for pod in pods:
        phase = pod["status"].get("phase", "?")
        phases[phase] = phases.get(phase, 0) + 1
    assert set(phases) <= {"Succeeded"}, phases
    assert {pod["spec"].get("nodeName") for pod in pods} <= set(kwok_nodes)
    # Pods the Job controller deleted as surplus, if any (its events say so).
    events = k8s_cluster.core.list_namespaced_event(
        k8s_namespace, field_selector=f"involvedObject.name={name},reason=SuccessfulDelete"
    ).items
    deleted = sum(event.count or 1 for event in events)
    print(
        f"job {JOB_COMPLETIONS}x/{JOB_PARALLELISM} completed in {elapsed:.1f}s; "
        f"pods {phases}; deleted by the Job controller: {deleted}"
    )


def _running_pod(k8s_cluster, namespace: str, name: str) -> None:
    template = _pod_template({"app": name})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template["metadata"]},
        "spec": template["spec"],
    }
    k8s_cluster.core.create_namespaced_pod(namespace, pod)
    kc.wait_for(
        lambda: (
            k8s_cluster.core.read_namespaced_pod_status(name, namespace).status.phase == "Running"
        ),
        60,
        f"Pod {namespace}/{name} Running on a KWOK node",
    )


def _read_log_when(k8s_cluster, namespace: str, name: str, expected: str) -> str:
    # KWOK serves the log once its informer has seen the Logs object: poll the first reads.
    last = {"text": None}

    def read():
        last["text"] = k8s_cluster.core.read_namespaced_pod_log(name, namespace)
        return last["text"] == expected

    with contextlib.suppress(TimeoutError):
        kc.wait_for(read, 30, f"log of Pod {namespace}/{name}", interval=0.5)
    return last["text"]


def test_simulated_pod_log_through_api_server(k8s_cluster, k8s_namespace, kwok_nodes, kwok_logs):
    lines = ["rollout episode 1 started", "step=1 reward=0.25", "episode done: ok"]
    _running_pod(k8s_cluster, k8s_namespace, "logger")
    kwok_logs("logger", lines)
    expected = "".join(f"{line}\n" for line in lines)
    assert _read_log_when(k8s_cluster, k8s_namespace, "logger", expected) == expected


def test_cluster_logs_match_pods_by_namespace(k8s_cluster, k8s_namespace, kwok_nodes, tmp_path):
    lines = ["served by a ClusterLogs rule"]
    _running_pod(k8s_cluster, k8s_namespace, "any-pod")
    path = kc.write_cri_log(tmp_path / "cluster.log", lines)
    name = f"{k8s_namespace}-logs"
    kc.create_cluster_logs(k8s_cluster, name, path, namespaces=[k8s_namespace])
    try:
        expected = "served by a ClusterLogs rule\n"
        assert _read_log_when(k8s_cluster, k8s_namespace, "any-pod", expected) == expected
    finally:
        kc.delete_cluster_logs(k8s_cluster, name)

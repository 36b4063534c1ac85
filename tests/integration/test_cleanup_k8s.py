"""Nothing left behind after a batch on Kubernetes (issue 16), and batches that survive a frozen
API server. Pods really run on the local cluster's real node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from kubernetes.client.rest import ApiException

from rollout_wire import constants as k
from rollout_worker.cli.stack import LocalStack
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

GONE_WITHIN_SECONDS = 120


def our_namespaces(cluster, batch_id: str) -> list[str]:
    found = cluster.core.list_namespace(label_selector=f"{k.LABEL_BATCH}={batch_id}")
    return [ns.metadata.name for ns in found.items]


def wait_gone(cluster, batch_id: str, timeout: float = GONE_WITHIN_SECONDS) -> float:
    """Seconds until no namespace of the batch is left (fails after `timeout`)."""
    start = time.monotonic()
    while our_namespaces(cluster, batch_id):
        assert time.monotonic() - start < timeout, f"batch {batch_id}: namespace still there"
        time.sleep(0.2)
    return time.monotonic() - start


def test_all_in_one_on_the_real_node_leaves_no_namespace(real_node, k8s_cluster):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_worker.cli",
            "run",
            "--all-in-one",
            "--count",
            "10",
            *real_node.run_flags(),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KUBECONFIG": str(k8s_cluster.kubeconfig)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["successful_episodes"] == 10 and report["cleanup"] == "scheduled"
    # The stack stopped only after its workers deleted the run: nothing is left at exit.
    assert our_namespaces(k8s_cluster, report["batch_id"]) == []
    print(f"all-in-one: report -> exit {time.time() - report['reported_at']:.1f}s")


@pytest.fixture
def kube_stack_one(k8s_cluster):
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig)}
    with LocalStack(collectors=1, extra_env=env) as stack:
        stack.wait_ready()
        yield stack


def submit(client: RolloutClient, real_node, **request):
    return client.submit(backend="kubernetes", **real_node.batch_fields(), **request)


#: A test-owned finalizer on a ConfigMap in the batch's namespace: while it is there, Kubernetes
#: cannot finish deleting the namespace, so the run's cleanup stays at `deleting`.
HOLD_FINALIZER = "rollout.test/hold-namespace"
HOLD_NAME = "test-hold"


def hold_namespace(cluster, namespace: str) -> None:
    cluster.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": HOLD_NAME, "finalizers": [HOLD_FINALIZER]}}
    )


def release_namespace(cluster, namespace: str) -> None:
    """Remove the hold (a JSON patch: the ConfigMap, already being deleted, then goes)."""
    try:
        cluster.core.patch_namespaced_config_map(
            HOLD_NAME, namespace, [{"op": "remove", "path": "/metadata/finalizers"}]
        )
    except ApiException as exc:
        if exc.status != 404:
            raise


def test_a_control_worker_killed_during_cleanup_is_replaced_and_nothing_is_left(
    real_node, k8s_cluster, kube_stack_one
):
    """The only control worker dies while the run's cleanup is under way (Kubernetes deleting
    the namespace, the cleanup task looking again every few seconds): its replacement finishes
    the cleanup. A finalizer of the test's holds the namespace in its deletion until after the
    kill, so the kill always lands before the cleanup could finish."""
    stack = kube_stack_one
    client = RolloutClient(stack.redis_url)
    batch = submit(client, real_node, count=2)
    deadline = time.monotonic() + 120
    while not client.receipt(batch.batch_id).get("job_uid"):
        assert time.monotonic() < deadline, "the Job was never created"
        time.sleep(0.2)
    namespace = client.receipt(batch.batch_id)["namespace"]
    hold_namespace(k8s_cluster, namespace)
    try:
        report = batch.wait(300)
        assert report["successful_episodes"] == 2 and report["cleanup"] == "scheduled"
        # The cleanup task ran and asked Kubernetes to delete the namespace, which the hold
        # keeps from going: the cleanup is under way and cannot finish.
        deadline = time.monotonic() + 120
        while client.receipt(batch.batch_id).get("cleanup") != "deleting":
            assert time.monotonic() < deadline, client.receipt(batch.batch_id).get("cleanup")
            time.sleep(0.2)
        # Kill the only control worker (its main process, and with it its children).
        control = next(w for w in stack.workers if w.queue == k.QUEUE_CONTROL)
        os.killpg(control.proc.pid, signal.SIGKILL)
        control.proc.wait(10)
        killed_at = time.monotonic()
        stack.workers.remove(control)
        # Nothing runs cleanups now: what the receipt and the cluster say is how the kill
        # found them. Mid-cleanup: namespace being deleted, not gone.
        cleanup_seen = client.receipt(batch.batch_id).get("cleanup")
        assert cleanup_seen == "deleting", cleanup_seen
        held = k8s_cluster.core.read_namespace(namespace)
        assert held.metadata.deletion_timestamp is not None, held.metadata
    finally:
        release_namespace(k8s_cluster, namespace)
    stack.start_worker(k.QUEUE_CONTROL, "control2", pool="prefork", concurrency=2)
    wait_gone(k8s_cluster, batch.batch_id)
    # The replacement takes the cleanup over: the dead worker's task comes back after the
    # visibility timeout (40 s) and the kombu restore sweep (10 s), if it had it reserved.
    deadline = time.monotonic() + 120
    while client.receipt(batch.batch_id).get("cleanup") != "deleted":
        assert time.monotonic() < deadline, client.receipt(batch.batch_id).get("cleanup")
        time.sleep(0.2)
    gone_after = time.monotonic() - killed_at
    print(f"cleanup was {cleanup_seen!r} at the kill; gone {gone_after:.1f}s after")
    client.close()


def freeze_apiserver(seconds: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(kc.CLUSTER_SH), "freeze-apiserver", str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_batch_survives_a_frozen_api_server_and_the_next_batch_runs(
    real_node, k8s_cluster, kube_stack_one
):
    client = RolloutClient(kube_stack_one.redis_url)
    batch = submit(client, real_node, count=4, parallelism=2, deadline_seconds=300)
    deadline = time.monotonic() + 120
    while not client.receipt(batch.batch_id).get("job_uid"):
        assert time.monotonic() < deadline, "the Job was never created"
        time.sleep(0.2)
    freezer = freeze_apiserver(15)
    out, _ = freezer.communicate(timeout=120)
    assert freezer.returncode == 0, out
    report = batch.wait(400)
    assert (report["episodes"], report["successful_episodes"], report["reward_sum"]) == (4, 4, 4)
    wait_gone(k8s_cluster, batch.batch_id)
    # The control plane healed (controller-manager and scheduler restarted if they exited):
    # a new batch gets its Pods and runs.
    after = submit(client, real_node, count=2).wait(300)
    assert after["successful_episodes"] == 2, after["errors"]
    restarts = subprocess.run(
        ["bash", str(kc.CLUSTER_SH), "restarts"], capture_output=True, text=True, check=False
    ).stdout
    print(restarts)
    client.close()

"""What the real-node tests of sandbox hosts (issue 46) share: the host image, a pool of host
Pods (rollout_worker/backends/host/manifests.py's objects) created and listed through the API,
and the hosts' own view of themselves (their heartbeats in Redis, their processes)."""

from __future__ import annotations

import subprocess
import uuid

import pytest
from kubernetes import client as kube_client

from rollout_worker.backends.host import manifests
from rollout_worker.backends.host.queue import HostQueue
from tests.helm.test_chart_install import kube_images, kubectl_path

from . import cluster as kc


def node_address(cluster: kc.Cluster, node: kc.RealNode) -> str:
    found = cluster.core.read_node(node.name)
    return next(a.address for a in found.status.addresses if a.type == "InternalIP")


@pytest.fixture(scope="session")
def host_image(real_node) -> str:
    """The sandbox-host image, built from this tree and imported into the node's containerd
    (once a session: every module of host tests runs the same image)."""
    return kube_images()["ROLLOUT_KUBE_HOST_IMAGE"]


def host_pool(node: kc.RealNode, namespace: str, image: str, url: str, **changes):
    fields = {
        "namespace": namespace,
        "image": image,
        "redis_url": url,
        "slots": 2,
        "replicas": 2,
        "name": f"hosts-{uuid.uuid4().hex[:6]}",
        "image_pull_policy": node.image_pull_policy,
        "runtime_class": node.runtime_class,
        "node_selector": node.node_selector,
        "tolerations": tuple(node.tolerations),
        "termination_grace_seconds": 5,
    }
    return manifests.HostPool(**(fields | changes))


def create_pool(cluster: kc.Cluster, objects: list[dict]) -> None:
    policy, deployment = objects
    namespace = deployment["metadata"]["namespace"]
    kube_client.NetworkingV1Api(cluster.api_client).create_namespaced_network_policy(
        namespace, policy
    )
    kube_client.AppsV1Api(cluster.api_client).create_namespaced_deployment(namespace, deployment)


def pool_pods(cluster: kc.Cluster, pool: manifests.HostPool) -> list[str]:
    pods = cluster.core.list_namespaced_pod(
        pool.namespace, label_selector=manifests.pool_selector(pool)
    ).items
    return sorted(p.metadata.name for p in pods)


def kubectl_exec(cluster: kc.Cluster, namespace: str, pod: str, *argv: str) -> str:
    kubectl = [kubectl_path(), "--kubeconfig", str(cluster.kubeconfig), "-n", namespace]
    proc = subprocess.run(
        [*kubectl, "exec", pod, "--", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def wait_hosts(queue: HostQueue, names: set[str] | None, count: int, timeout: float) -> dict:
    """Until `count` hosts (of `names` when given) have a live heartbeat with every slot free."""

    def ready():
        alive = {
            name: info
            for name, info in queue.hosts().items()
            if (names is None or name in names) and info.get("free") == info.get("slots")
        }
        return alive if len(alive) >= count else None

    return kc.wait_for(ready, timeout, f"{count} live hosts", interval=0.5)


def with_lease(objects: list[dict], seconds: float) -> list[dict]:
    """The pool's objects with the agents' `--lease-seconds` set (the agent's own option): a
    killed host's episodes are taken back that much sooner than the default 15 s."""
    (container,) = objects[1]["spec"]["template"]["spec"]["containers"]
    container["command"] = [*container["command"], "--lease-seconds", str(seconds)]
    return objects

"""Task images on sandbox hosts, on the real node (issue 46): a host pool that carries the
Harbor image task's image (built from tests/data/harbor and imported into the node's
containerd) mounts it as a read-only Kubernetes image volume (KEP-4639, the ImageVolume gate
that hack/localkube turns on for 1.34) under the agent's --rootfs; its agents tell it in their
heartbeats, and an image-task batch (`isolation: host`, the oracle) runs each episode in a fresh
bubblewrap sandbox whose root is the image's files, its WORKDIR copied per episode: rewarded,
with nothing written into the shared image."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.host import manifests
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.backends.local.sandbox import rootfs_dirname
from rollout_worker.cli.stack import LocalStack
from tests.helm.test_chart_install import kubectl_path
from trainer_stub.client import RolloutClient

from . import cluster as kc
from .host_pool import create_pool, host_pool, kubectl_exec, node_address, pool_pods, wait_hosts

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / "tests" / "data" / "harbor"


@pytest.fixture(scope="module")
def image_task(real_node) -> dict:
    """The Harbor task that is its image (WORKDIR /app), built and imported into the node."""
    subprocess.run(["hack/docker-up.sh"], check=True, cwd=ROOT, timeout=600)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "tasks", "build", str(HARBOR)),
            *("--task", "image-task", "--node-import"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (task,) = load_task_set(str(HARBOR), ["image-task"])
    assert task["image"] and not task["files"] and task["workdir"] == "/app"
    return task


def test_a_host_pool_carrying_a_task_image_runs_that_task_in_its_image(
    k8s_cluster, k8s_namespace, real_node, host_image, image_task
):
    image = image_task["image"]
    folder = rootfs_dirname(image)
    mounted = f"{manifests.HOST_IMAGES}/{folder}"
    address = node_address(k8s_cluster, real_node)
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig)}
    with LocalStack(collectors=2, extra_env=env, redis_bind=address, password="hosts") as stack:
        stack.wait_ready()
        pool = host_pool(
            real_node,
            k8s_namespace,
            host_image,
            stack.redis_url_at(address),
            replicas=1,
            images=(manifests.TaskImage(image, "/app", real_node.image_pull_policy),),
        )
        started = time.monotonic()
        create_pool(k8s_cluster, manifests.host_objects(pool))
        queue = HostQueue(redis.Redis.from_url(stack.redis_url))
        ((name, info),) = wait_hosts(queue, None, 1, 180).items()
        print(f"a host Pod with the task image up in {time.monotonic() - started:.1f}s")
        assert info["images"] == [folder], info
        (pod,) = pool_pods(k8s_cluster, pool)
        assert name == pod
        # The image's files, read-only, as the image has them (no mount point of ours in it).
        listing = kubectl_exec(k8s_cluster, k8s_namespace, pod, "ls", "-A", mounted).split()
        assert "app" in listing and "sandbox" not in listing, listing
        greet = kubectl_exec(k8s_cluster, k8s_namespace, pod, "cat", f"{mounted}/app/greet.py")
        touch = subprocess.run(
            [
                *(kubectl_path(), "--kubeconfig", str(k8s_cluster.kubeconfig)),
                *("-n", k8s_namespace),
                *("exec", pod, "--", "touch", f"{mounted}/app/planted"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert touch.returncode != 0 and "Read-only file system" in touch.stderr, touch
        # Whether the image volume is idmapped in the Pod's user namespace (docs/sandbox-hosts.md,
        # open question 3): its root-owned files show as 0 when it is, 65534 when not.
        owner = kubectl_exec(k8s_cluster, k8s_namespace, pod, "stat", "-c", "%u", mounted)
        print(f"image volume's root owned by uid {owner.strip()} inside the host Pod")

        client = RolloutClient(stack.redis_url)
        submission = client.submit(
            backend="kubernetes",
            isolation="host",
            tasks=[image_task | {"agent": "oracle"}],
            samples_per_task=2,
            parallelism=2,
        )
        report = client.wait(submission.batch_id, timeout=300)
        assert report["ok"], report["errors"]
        rows = report["pods"]
        # The oracle writes /app/greet.py and the tests read it there: the image's WORKDIR,
        # which the host's own root does not have.
        assert [(r["status"], r["reward"]) for r in rows] == [("ok", 1), ("ok", 1)], rows
        assert {r["node"] for r in rows} == {pod}
        assert len({r["pod"] for r in rows}) == 2  # a fresh sandbox each
        # Each episode edited its own copy: the shared image is as it was.
        after = kubectl_exec(k8s_cluster, k8s_namespace, pod, "cat", f"{mounted}/app/greet.py")
        assert after == greet
        kc.wait_for(
            lambda: client.receipt(submission.batch_id).get("cleanup") == "deleted",
            120,
            "the run's cleanup",
        )
        client.close()

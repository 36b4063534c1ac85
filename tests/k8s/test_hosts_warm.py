"""Warm sandboxes inside a host Pod on the real node (issue 46): a batch with `warm_pool` has
its episodes after the first handed to bwrap sandboxes that the agent started in its Pod
before it took them (rollout_worker/backends/host/warm.py), where user namespaces are off
(the agent's `--disable-userns` path, hostUsers: false); once the batch has nothing left to
take, no waiting sandbox, bwrap process or folder of it stays in the Pod.

One stack, one scripted policy and one host Pod x 3 slots (tests/k8s/host_pool.py), the
helpers of test_hosts_guarantees.py. The proof that an episode ran warm is written by the
agent in the Pod (its status's `sandbox` and `timing.pool_created_at`) and counted by the
workers (the report's `warm_episodes`); the processes are counted in the Pod."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis

from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.host import manifests
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.backends.host.warm import WARM_DIR
from rollout_worker.cli.policy_server import running
from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

from . import cluster as kc
from .host_pool import create_pool, host_pool, kubectl_exec, node_address, wait_hosts
from .test_hosts_guarantees import FAST_TASK, Hosts

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

# 3 slots for parallelism 2: a waiting sandbox always has a slot beside the batch's two
# running episodes, so the episode taken when one ends finds it (with 2 slots it would race
# the agent's next start of one).
SLOTS = 3
COUNT = 4

# Run in the host Pod: the folders named `warm` left under the agent's root (a run's waiting
# and handed-out sandboxes' homes are <root>/<batch>/warm/<name>).
WARM_FOLDERS = """\
import json, os, sys
root = sys.argv[1]
print(json.dumps(sorted(os.path.relpath(d, root) for d, _, _ in os.walk(root)
                        if os.path.basename(d) == sys.argv[2])))
"""


@pytest.fixture(scope="module")
def warm_hosts(k8s_cluster, real_node, host_image) -> Iterator[Hosts]:
    namespace = kc.create_test_namespace(k8s_cluster, "host-warm")
    address = node_address(k8s_cluster, real_node)
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig)}
    try:
        with (
            LocalStack(extra_env=env, redis_bind=address, password=uuid.uuid4().hex) as stack,
            running(host="0.0.0.0") as server,
        ):
            stack.wait_ready()
            url = stack.redis_url_at(address)
            endpoints = (manifests.Endpoint(f"{address}/32", server.port),)
            pool = host_pool(
                real_node,
                namespace,
                host_image,
                url,
                slots=SLOTS,
                replicas=1,
                policy_egress=endpoints,
            )
            create_pool(k8s_cluster, manifests.host_objects(pool))
            queue = HostQueue(redis.Redis.from_url(stack.redis_url))
            client = RolloutClient(stack.redis_url)
            policy_url = f"http://{address}:{server.port}"
            # No paced policy here: the plain one stands in for it (no test here uses it).
            found = Hosts(
                k8s_cluster,
                namespace,
                pool,
                stack,
                server,
                queue,
                client,
                policy_url,
                server,
                policy_url,
            )
            wait_hosts(queue, None, 1, 180)
            yield found
            client.close()
    finally:
        kc.delete_namespace(k8s_cluster, namespace)


def test_a_warm_pool_batch_runs_in_waiting_sandboxes_of_the_host_pod_and_leaves_none(
    warm_hosts,
):
    hosts = warm_hosts
    (pod,) = hosts.names()
    hosts.idle()
    # The agent in the Pod builds its sandboxes, the waiting ones too (the run document it
    # localises carries it), with --disable-userns, as it says at its start.
    said = hosts.cluster.core.read_namespaced_pod_log(pod, hosts.namespace)
    assert "user namespaces inside: forbidden" in said, said[-2000:]
    batch = hosts.submit(
        tasks=load_task_set("bundled", only=[FAST_TASK]),
        samples_per_task=COUNT,
        parallelism=2,
        warm_pool=2,
        # The run stays after its report: its statuses (each with the agent's `sandbox`) are
        # read below, and its waiting sandboxes must go because nothing is left to take, not
        # because the run was deleted.
        keep_run=True,
        policy=hosts.policy(),
    )
    report, entries = hosts.follow(batch, 120)
    assert report["ok"] and report["status"] == "succeeded", report["errors"]
    # Preflight found the tasks fit for waiting sandboxes (else: "the hosts start ... cold").
    assert not [w for w in report["warnings"] if "warm_pool" in w], report["warnings"]
    # Every episode once, with its reward, in the Pod.
    assert dict(entries) == dict.fromkeys(range(COUNT), 1), f"stream entries {entries}"
    rows = sorted(report["pods"], key=lambda r: r["created_at"])
    assert sorted(r["index"] for r in rows) == list(range(COUNT)), report["errors"]
    assert [(r["status"], r["reward"]) for r in rows] == [("ok", 1)] * COUNT, report["errors"]
    assert {r["node"] for r in rows} == {pod}, rows
    assert len({r["pod"] for r in rows}) == COUNT  # each in its own sandbox
    assert report["retries"] == 0 and report["infrastructure_failures"] == 0, report["errors"]

    # Ran warm: the report counts the episodes whose sandbox the agent started before it took
    # them (0 when no waiting sandbox ever started or lived in the Pod). The first one taken
    # had nothing waiting yet.
    warm = [r for r in rows if "pool_created_at" in r["timing"]]
    assert report["warm_episodes"] == len(warm) >= 1, rows
    assert rows[0] not in warm, rows[0]
    assert all(r["timing"]["pool_created_at"] < r["created_at"] for r in warm), warm
    # The agent's own record of each: the waiting sandbox it handed the episode to, one each.
    statuses = hosts.queue.statuses(batch)
    handed = {i: s.get("sandbox") for i, s in statuses.items()}
    assert {i for i, name in handed.items() if name} == {r["index"] for r in warm}, handed
    names = [handed[r["index"]] for r in warm]
    assert all(name.startswith("warm-") for name in names) and len(set(names)) == len(names)

    # Nothing left in the Pod: no sandbox (waiting or not), no folder of the batch, no warm
    # folder; every slot free and nothing waiting, as the agent heartbeats.
    kc.wait_for(lambda: not hosts.sandboxes()[pod], 15, f"no bwrap left in {pod}", interval=1)

    def folders_gone():
        listed = kubectl_exec(hosts.cluster, hosts.namespace, pod, "ls", manifests.HOST_ROOT)
        return batch not in listed.split()

    # The agent drops an idle run's folder IDLE_KEEP_SECONDS (5 s) after its last episode.
    kc.wait_for(folders_gone, 30, f"{pod} to remove its folder of {batch}", interval=1)
    script = ["python3", "-c", WARM_FOLDERS, manifests.HOST_ROOT, WARM_DIR]
    left = json.loads(kubectl_exec(hosts.cluster, hosts.namespace, pod, *script))
    assert left == [], left

    def all_free():
        info = hosts.queue.hosts().get(pod) or {}
        done = info.get("free") == SLOTS and info.get("waiting") == 0
        return info if done and not info.get("batches") else None

    kc.wait_for(all_free, 15, f"{pod} to heartbeat {SLOTS} slots free, none waiting")

"""Sandbox hosts on the real node (issue 46): the host pool that
rollout_worker/backends/host/manifests.py builds, in the host image that
docker/build-kube-image.sh makes (`--target host`: the workers' code plus bubblewrap), reaches the
test's Redis at the node's address (LocalStack.redis_bind) and runs the local backend's sandbox
in each of its Pods."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from kubernetes import client as kube_client

from rollout_wire import constants as k
from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.host import manifests
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.cli.policy_server import running
from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

from . import cluster as kc
from .host_pool import (
    create_pool,
    host_pool,
    kubectl_exec,
    node_address,
    pool_pods,
    wait_hosts,
    with_lease,
)
from .test_sandbox_host import PROBE, _sandbox_argv

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

REPORTS = "test-hosts:reports"

# What each host Pod runs instead of the agent: it reports to the Redis its Deployment names,
# then stays up as a host does. It checks the Pod as the agent will find it: its sandbox runs,
# bubblewrap is not setuid, the pause process is PID 1 (it reaps what sandboxes leave), the
# root is read-only, the scratch folder is writable, and there is no API token.
POD_PROBE = """\
import json, os, shutil, subprocess, time
import redis
os.makedirs(os.environ['WORKSPACE'], exist_ok=True)
with open(os.environ['PROGRAM'], 'w') as f:
    f.write(os.environ['PROBE'])
done = subprocess.run(json.loads(os.environ['SANDBOX_ARGV']), capture_output=True, text=True,
                      timeout=60)
bwrap = shutil.which('bwrap')
try:
    open('/probe-root', 'w')
    root_writable = True
except OSError:
    root_writable = False
scratch = os.path.join(os.environ['HOST_ROOT'], 'probe')
open(scratch, 'w').write('x')
report = {
    'pod': os.environ['HOSTNAME'], 'rc': done.returncode, 'out': done.stdout, 'err': done.stderr,
    'bwrap_setuid': bool(os.stat(bwrap).st_mode & 0o4000),
    'pid1': open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode(),
    'root_writable': root_writable, 'scratch': os.path.exists(scratch),
    'token': os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token'),
    'uid': os.getuid(),
}
redis.Redis.from_url(os.environ['ROLLOUT_REDIS_URL']).rpush(os.environ['REPORTS'],
                                                           json.dumps(report))
time.sleep(3600)
"""


def test_host_pods_reach_the_stacks_redis_and_run_the_sandbox(
    k8s_cluster, k8s_namespace, real_node, host_image
):
    address = node_address(k8s_cluster, real_node)
    stack = LocalStack(redis_bind=address, password=uuid.uuid4().hex)
    stack.start_redis()
    try:
        pool = host_pool(real_node, k8s_namespace, host_image, stack.redis_url_at(address))
        objects = manifests.host_objects(pool)
        (container,) = objects[1]["spec"]["template"]["spec"]["containers"]
        container["command"] = ["python3", "-B", "-c", POD_PROBE]
        container["env"] += [
            {"name": name, "value": value}
            for name, value in {
                "PROGRAM": "/tmp/probe.py",
                "WORKSPACE": "/tmp/workspace",
                "PROBE": PROBE,
                "SANDBOX_ARGV": json.dumps(_sandbox_argv()),
                "HOST_ROOT": manifests.HOST_VOLUME,
                "REPORTS": REPORTS,
            }.items()
        ]
        started = time.monotonic()
        create_pool(k8s_cluster, objects)
        client = redis.Redis.from_url(stack.redis_url)

        def both_reported():
            return client.llen(REPORTS) >= 2 or None

        kc.wait_for(both_reported, 180, "both host Pods to report", interval=0.5)
        reports = [json.loads(r) for r in client.lrange(REPORTS, 0, -1)]
        print(f"2 host Pods up and reporting in {time.monotonic() - started:.1f}s")
        assert sorted(r["pod"] for r in reports) == pool_pods(k8s_cluster, pool)
        for report in reports:
            assert report["rc"] == 0, report
            facts = json.loads(report["out"])
            assert (facts["uid"], facts["pid"], facts["procs"]) == (1000, 1, [1]), report
            assert facts["net"] == ["lo"] and facts["cap_eff"] == "0000000000000000", report
            assert report["bwrap_setuid"] is False and report["uid"] == 1000, report
            assert report["pid1"] == "/pause", report  # shareProcessNamespace: pause reaps
            assert report["root_writable"] is False and report["scratch"] is True, report
            assert report["token"] is False, report
        kube_client.AppsV1Api(k8s_cluster.api_client).delete_namespaced_deployment(
            pool.name, k8s_namespace
        )
        kc.wait_for(lambda: not pool_pods(k8s_cluster, pool), 120, "the host Pods to go")
    finally:
        stack.stop()


def test_hosts_run_a_batch_once_each_and_lose_nothing_to_a_killed_host(
    k8s_cluster, k8s_namespace, real_node, host_image
):
    """2 host Pods x 2 slots run the bundled tasks x 2 (`isolation: host`): every row once,
    each on a host Pod; one host killed (grace 0) mid-batch loses nothing (infra_retries=1:
    its episodes run again elsewhere, `retried` says HostLost); after the run's cleanup no key
    of the batch is left, nor its folder in any host."""
    address = node_address(k8s_cluster, real_node)
    env = {"KUBECONFIG": str(k8s_cluster.kubeconfig)}
    tasks = load_task_set("bundled")
    with (
        LocalStack(collectors=2, extra_env=env, redis_bind=address, password="hosts") as stack,
        # Each policy turn takes 2 s: episodes outlast the kubelet's 2 s kill of a force-deleted
        # Pod (SIGTERM lets the agent drain only that long), so the killed host loses some.
        running(host="0.0.0.0", turn_seconds=2.0) as server,
    ):
        stack.wait_ready()
        endpoint = manifests.Endpoint(f"{address}/32", server.port)
        pool = host_pool(
            real_node,
            k8s_namespace,
            host_image,
            stack.redis_url_at(address),
            policy_egress=(endpoint,),
        )
        # A 5 s lease (the agent's option; default 15 s): the killed host's episodes run
        # again elsewhere that much sooner, which is all the kill waits on.
        create_pool(k8s_cluster, with_lease(manifests.host_objects(pool), 5))
        queue = HostQueue(redis.Redis.from_url(stack.redis_url))
        wait_hosts(queue, None, 2, 180)
        hosts = set(pool_pods(k8s_cluster, pool))
        assert set(queue.hosts()) == hosts, (queue.hosts(), hosts)

        client = RolloutClient(stack.redis_url)
        started = time.monotonic()
        submission = client.submit(
            backend="kubernetes",
            isolation="host",
            tasks=tasks,
            samples_per_task=2,
            parallelism=4,
            infra_retries=1,
            policy={"url": f"http://{address}:{server.port}", "request_timeout_seconds": 10},
        )
        batch = submission.batch_id
        count = len(tasks) * 2

        # Kill the host that holds the most running episodes, once it holds one.
        def busy_host():
            taken = queue.taken(batch)
            return max(set(taken.values()), key=list(taken.values()).count) if taken else None

        victim = kc.wait_for(busy_host, 60, "a host to take an episode", interval=0.1)
        lost = {i for i, host in queue.taken(batch).items() if host == victim}
        k8s_cluster.core.delete_namespaced_pod(victim, k8s_namespace, grace_period_seconds=0)
        report = client.wait(batch, timeout=240)
        elapsed = time.monotonic() - started
        print(f"{count} episodes on 2 hosts x 2 slots, one host killed: {elapsed:.1f}s")

        assert report["ok"], report["errors"]
        assert report["run_isolation"] == "host"
        rows = report["pods"]
        assert sorted(r["index"] for r in rows) == list(range(count))  # every row, once
        assert len({r["pod"] for r in rows}) == count  # each its own sandbox
        assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
        hosts_now = set(pool_pods(k8s_cluster, pool))
        assert {r["node"] for r in rows} <= hosts | hosts_now, {r["node"] for r in rows}
        # What the killed host held either ended there before the kill landed, or ran again
        # on another host, its first attempt recorded as HostLost; nothing else was retried.
        retried = [r for r in rows if r["retried"]]
        assert retried, f"no episode of {victim} was lost: {sorted(lost)}"
        for row in rows:
            if row["retried"]:
                assert row["index"] in lost and row["node"] != victim, row
                assert [a["reason"] for a in row["retried"]] == ["HostLost"], row
            elif row["index"] in lost:
                assert row["node"] == victim, row

        kc.wait_for(
            lambda: client.receipt(batch).get("cleanup") == "deleted", 120, "the run's cleanup"
        )
        # The run is gone (its rows and report stay, as every backend's records do).
        leftover = list(queue.redis.scan_iter(k.host_batch_key(batch, "*")))
        assert leftover == [], leftover
        assert batch not in queue.runs()
        assert not [i for i in queue.redis.lrange(k.HOSTS_TODO_KEY, 0, -1) if batch in str(i)]
        live = set(pool_pods(k8s_cluster, pool))
        for pod in live:
            # A host drops a batch's folder at its next look once the run is gone.
            def gone(pod=pod):
                ls = kubectl_exec(k8s_cluster, k8s_namespace, pod, "ls", manifests.HOST_ROOT)
                return batch not in ls.split()

            kc.wait_for(gone, 30, f"{pod} to remove its folder of {batch}", interval=1)
        for name, info in wait_hosts(queue, live, len(live), 30).items():
            assert not info.get("batches"), (name, info)
        client.close()

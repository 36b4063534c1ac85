"""Sandbox hosts on the real node (issue 46): the host pool that
rollout_worker/backends/host/manifests.py builds, in the host image that
docker/build-kube-image.sh makes (`--target host`: the workers' code plus bubblewrap), reaches the
test's Redis at the node's address (LocalStack.redis_bind) and runs the local backend's sandbox
in each of its Pods. A batch on such a pool, one host killed mid-batch, runs on the pool of
test_hosts_guarantees.py (one stack and pool for every host batch)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from kubernetes import client as kube_client

from rollout_worker.backends.host import manifests
from rollout_worker.cli.stack import LocalStack

from . import cluster as kc
from .host_pool import create_pool, host_pool, node_address, pool_pods
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

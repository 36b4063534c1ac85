"""The chart on the local cluster, end to end: `helm install` with the workers as Pods on the
real node (image imported into its containerd), RBAC enforced by the API server
(--authorization-mode=Node,RBAC), a trainer outside the cluster (this process) submitting
batches that really run on the real node, `helm test`, `rollout check` inside a worker Pod,
negative checks with the workers' own token, `helm upgrade` to more collectors during a
batch, and `helm uninstall` leaving only what the chart's README says stays.

The real node has no kube-proxy, no cluster DNS, and Pods reach only the node, while the API
server listens on 127.0.0.1: the release runs with hostNetwork=true (Redis binds 127.0.0.1 on
a free port) and kubernetesApi.host=127.0.0.1 / port=<the API server's port> (see
deploy/chart/README.md, "Clusters without a Pod network").
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from rollout_wire.errors import OwnershipError
from rollout_wire.request import parse_spec
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube import permissions
from rollout_worker.backends.kube.backend import KubernetesBackend
from rollout_worker.backends.kube.objects import namespace_name
from rollout_worker.settings import Settings
from tests.helm.conftest import CHART, ROOT, run_helm
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.helm, pytest.mark.slow]

IMAGE_BUILD_TIMEOUT = 1800
INSTALL_TIMEOUT = "6m"
# Other suites may run Pods on the same 2-CPU node at the same time: wait for room rather than
# fail the capacity check (which the workers still run, with their own permissions).
BATCH = {"capacity_check": "warn"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubectl_path() -> str:
    cache = Path(os.environ.get("ROLLOUT_LOCALKUBE_CACHE", "/var/cache/rollout-localkube"))
    pinned = sorted(cache.glob("v*/bin/kubectl"))
    return str(pinned[-1]) if pinned else (shutil.which("kubectl") or "kubectl")


def kube_images() -> dict[str, str]:
    """Build the worker image and the Redis image, import them into the node's containerd."""
    return dict(_kube_images())


# Once a session (the chart test, the two-image test and the host tests all ask): the tree
# does not change during a run, and the node's containerd keeps the images (pinned, and no test
# removes one). A call that fails is not remembered: the next one builds again.
@functools.cache
def _kube_images() -> dict[str, str]:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(ROOT / "hack" / "docker-up.sh")], check=True, timeout=1200)
    proc = subprocess.run(
        ["bash", str(ROOT / "docker" / "build-kube-image.sh"), "--import"],
        capture_output=True,
        text=True,
        timeout=IMAGE_BUILD_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split("=", 1) for line in proc.stdout.split())


def token_client(cluster: kc.Cluster, namespace: str, sa: str, kubeconfig: Path) -> Path:
    """A kubeconfig holding a fresh token of the workers' ServiceAccount (their identity)."""
    token = cluster.core.create_namespaced_service_account_token(
        sa, namespace, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    admin_cluster = admin["clusters"][0]["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": admin_cluster}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "workers", "context": {"cluster": "c", "user": sa}}],
        "current-context": "workers",
    }
    kubeconfig.write_text(yaml.safe_dump(config))
    return kubeconfig


def status_of(fn, *args) -> int:
    try:
        fn(*args)
    except ApiException as exc:
        return exc.status
    return 200


def assert_real_report(report: dict, count: int, node: str) -> None:
    assert report["ok"] is True, report.get("errors", [])[:5]
    assert report["successful_episodes"] == count and report["reward_sum"] == count
    assert sorted(row["index"] for row in report["pods"]) == list(range(count))
    assert {row["node"] for row in report["pods"]} == {node}


def wait_deleted(rollout: RolloutClient, batch_id: str, timeout: float = 180) -> None:
    kc.wait_for(
        lambda: rollout.receipt(batch_id).get("cleanup") == "deleted",
        timeout,
        f"cleanup of batch {batch_id}",
        interval=1,
    )


def test_chart_installs_serves_scales_and_uninstalls(
    helm, local_k8s_cluster, real_node, tmp_path, record_property
):
    cluster = local_k8s_cluster
    kubectl = kubectl_path()
    kubeconfig = str(cluster.kubeconfig)
    api_port = urlparse(
        yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    ).port
    images = kube_images()
    suffix = uuid.uuid4().hex[:8]
    ns, release = f"helm-rollout-{suffix}", "rl"
    full = f"{release}-rollout"
    sa = full
    storage_class = f"rollout-helm-{suffix}"
    redis_port, flower_port = free_port(), free_port()
    data_dir = Path(f"/var/lib/rollout-helm-test/{suffix}")
    timings: dict[str, float] = {}
    victims: list[str] = []

    def helm_(*args: str, timeout: float = 600):
        return run_helm(helm, *args, "--kubeconfig", kubeconfig, timeout=timeout)

    def kubectl_(*args: str, check: bool = True, timeout: float = 120):
        proc = subprocess.run(
            [kubectl, "--kubeconfig", kubeconfig, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert not check or proc.returncode == 0, f"kubectl {args}: {proc.stdout}{proc.stderr}"
        return proc

    # Redis persistence: a static PersistentVolume on the real node, of a class of our own.
    data_dir.mkdir(parents=True)
    os.chown(data_dir, 999, 999)
    cluster.core.create_persistent_volume(
        {
            "metadata": {"name": storage_class, "labels": {"rollout.test/helm": suffix}},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": storage_class,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(data_dir), "type": "Directory"},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": kc.REAL_NODE_LABEL_KEY,
                                        "operator": "In",
                                        "values": [kc.REAL_NODE_LABEL_VALUE],
                                    }
                                ]
                            }
                        ]
                    }
                },
            },
        }
    )
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "image": {
                    "repository": images["ROLLOUT_KUBE_IMAGE"].rsplit(":", 1)[0],
                    "tag": images["ROLLOUT_KUBE_IMAGE"].rsplit(":", 1)[1],
                    "pullPolicy": "Never",
                },
                "hostNetwork": True,
                "kubernetesApi": {"host": "127.0.0.1", "port": str(api_port)},
                "nodeSelector": real_node.node_selector,
                "tolerations": real_node.tolerations,
                "control": {"replicas": 1},
                # Two slots: a batch outgrows one collector, so new ones get work.
                "collect": {"replicas": 1, "concurrency": 2},
                "flower": {"enabled": True, "port": flower_port},
                "redis": {
                    "image": {
                        "repository": images["ROLLOUT_KUBE_REDIS_IMAGE"].rsplit(":", 1)[0],
                        "tag": images["ROLLOUT_KUBE_REDIS_IMAGE"].rsplit(":", 1)[1],
                        "pullPolicy": "Never",
                    },
                    "port": redis_port,
                    "persistence": {"storageClass": storage_class, "size": "1Gi"},
                },
                "tests": {"runtime": real_node.runtime_class},
            }
        )
    )
    rollout = RolloutClient(f"redis://127.0.0.1:{redis_port}/0")
    installed = False
    try:
        # ---- install, then the first batch (a trainer outside the cluster) ------------------
        t0 = time.monotonic()
        helm_(
            "install", release, str(CHART), "-n", ns, "--create-namespace", "-f", str(values),
            "--wait", "--timeout", INSTALL_TIMEOUT,
        )  # fmt: skip
        installed = True
        timings["helm_install_wait_s"] = time.monotonic() - t0
        first = rollout.submit(
            count=4, parallelism=4, backend="kubernetes", **BATCH, **real_node.batch_fields()
        )
        report = rollout.wait(first.batch_id, timeout=300)
        timings["helm_install_to_first_report_s"] = time.monotonic() - t0
        assert_real_report(report, 4, real_node.name)

        # ---- helm test, and rollout check in a worker Pod -----------------------------------
        t = time.monotonic()
        # Not --logs: the hook deletes a Pod that succeeded (hooks are not removed by uninstall).
        helm_("test", release, "-n", ns, "--timeout", "3m")
        timings["helm_test_s"] = time.monotonic() - t
        check = kubectl_(
            "-n", ns, "exec", f"deploy/{full}-control", "--",
            "rollout", "check", "--kubernetes", "--runtime", real_node.runtime_class,
        )  # fmt: skip
        print(check.stdout)
        lines = check.stdout.splitlines()
        for p in permissions.PERMISSIONS:
            for verb in p.verbs:
                line = f"permission {verb} {p.api_group}/{p.resource} ({p.scope}): granted"
                assert line in lines, check.stdout
        for group, resource, verb in permissions.MUST_NOT:
            assert f"not needed {verb} {group or 'core'}/{resource}: denied" in lines

        # ---- negative checks with the workers' own identity ----------------------------------
        workers_cfg = token_client(cluster, ns, sa, tmp_path / "workers.kubeconfig")
        as_workers = kc._api_client(workers_cfg)
        core = client.CoreV1Api(as_workers)
        victim = f"helm-victim-{suffix}"
        victims.append(victim)
        cluster.core.create_namespace({"metadata": {"name": victim}})
        assert status_of(core.list_namespaced_secret, ns) == 403
        assert status_of(core.read_namespaced_secret, f"{full}-redis-url", ns) == 403
        assert status_of(core.list_secret_for_all_namespaces) == 403
        pod = {
            "metadata": {"name": "direct"},
            "spec": {
                "containers": [{"name": "c", "image": real_node.image}],
                **real_node.placement(),
            },
        }
        assert status_of(core.create_namespaced_pod, victim, pod) == 403  # no Pods outside Jobs
        assert status_of(core.delete_collection_namespaced_pod, ns) == 403
        token_request = {"spec": {"expirationSeconds": 600}}
        assert status_of(core.create_namespaced_service_account_token, sa, ns, token_request) == 403
        # kubectl auth can-i as the ServiceAccount (impersonation), as an operator would ask.
        who = f"system:serviceaccount:{ns}:{sa}"
        for verb, what in (("get", "secrets"), ("create", "pods"), ("create", "pods/exec")):
            proc = kubectl_("auth", "can-i", verb, what, "-A", f"--as={who}", check=False)
            assert proc.stdout.strip() == "no", (verb, what, proc.stdout, proc.stderr)
        proc = kubectl_("auth", "can-i", "create", "jobs.batch", "-A", f"--as={who}")
        assert proc.stdout.strip() == "yes"
        review_lines, review_problems = permissions.access_review(as_workers)
        assert review_problems == [], review_problems
        assert not [line for line in review_lines if "more than needed" in line]
        # RBAC lets the workers delete any namespace; the code refuses what is not ours.
        backend = KubernetesBackend(Settings.from_env({"KUBECONFIG": str(workers_cfg)}))
        uid = cluster.core.read_namespace(victim).metadata.uid
        handle = KubeRunHandle(
            backend="kubernetes", batch_id="victim", origin=0.0, episode_prefix="episode",
            context="workers", namespace=victim, namespace_uid=uid, job_name="episode",
            job_uid="x",
        )  # fmt: skip
        with pytest.raises(OwnershipError):
            backend.delete_run(handle)
        assert cluster.core.read_namespace(victim).status.phase == "Active"
        squat_id = f"squat{suffix}"
        squatted = namespace_name(squat_id)
        victims.append(squatted)
        cluster.core.create_namespace({"metadata": {"name": squatted}})
        spec = parse_spec(
            {"batch_id": squat_id, "count": 1, "backend": "kubernetes", **real_node.batch_fields()},
            max_episodes=1,
        )
        with pytest.raises(OwnershipError):
            backend.start_run(spec, lambda update: None)
        assert not cluster.batch.list_namespaced_job(squatted).items

        # ---- Redis restarts from its volume (AOF): the first batch's records are still there ---
        wait_deleted(rollout, first.batch_id)
        time.sleep(1.5)  # appendfsync everysec
        old_uid = cluster.core.read_namespaced_pod(f"{full}-redis-0", ns).metadata.uid
        cluster.core.delete_namespaced_pod(f"{full}-redis-0", ns, grace_period_seconds=0)
        t = time.monotonic()

        def redis_back():
            pod = cluster.core.read_namespaced_pod(f"{full}-redis-0", ns)
            ready = any(
                c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
            )
            return pod.metadata.uid != old_uid and ready

        kc.wait_for(redis_back, 120, "Redis to come back", interval=0.5)
        timings["redis_restart_s"] = time.monotonic() - t

        def first_report():
            try:
                return rollout.report(first.batch_id)
            except redis.RedisError:
                return None

        assert (
            kc.wait_for(first_report, 30, "the first report after a Redis restart")[
                "successful_episodes"
            ]
            == 4
        )
        assert rollout.receipt(first.batch_id).get("cleanup") == "deleted"

        # ---- more collectors during a second batch -------------------------------------------
        second = rollout.submit(
            count=12, parallelism=3, backend="kubernetes", **BATCH, **real_node.batch_fields()
        )
        t = time.monotonic()
        helm_(
            "upgrade", release, str(CHART), "-n", ns, "--reset-then-reuse-values",
            "--set", "collect.replicas=3", "--wait", "--timeout", INSTALL_TIMEOUT,
        )  # fmt: skip
        timings["helm_upgrade_s"] = time.monotonic() - t
        assert rollout.report(second.batch_id) is None, "the batch ended before the upgrade"
        report2 = rollout.wait(second.batch_id, timeout=300)
        assert_real_report(report2, 12, real_node.name)
        collect = client.AppsV1Api(cluster.api_client).read_namespaced_deployment(
            f"{full}-collect", ns
        )
        assert collect.status.ready_replicas == 3
        pods = cluster.core.list_namespaced_pod(
            ns, label_selector="app.kubernetes.io/component=collect"
        ).items
        busy = [
            p.metadata.name
            for p in pods
            if "collect_episode" in cluster.core.read_namespaced_pod_log(p.metadata.name, ns)
        ]
        record_property("collectors_that_ran_tasks", len(busy))
        print(f"collectors that ran collect tasks in batch 2: {len(busy)} of {len(pods)}")
        assert len(busy) >= 2, "no new collector took a task"
        wait_deleted(rollout, second.batch_id)

        # ---- fewer collectors during a third batch: warm shutdown loses nothing ---------------
        third = rollout.submit(
            count=6, parallelism=3, backend="kubernetes", **BATCH, **real_node.batch_fields()
        )
        kc.wait_for(lambda: rollout.receipt(third.batch_id).get("job_uid"), 60, "batch 3 to start")
        t = time.monotonic()
        helm_(
            "upgrade", release, str(CHART), "-n", ns, "--reset-then-reuse-values",
            "--set", "collect.replicas=1", "--wait", "--timeout", INSTALL_TIMEOUT,
        )  # fmt: skip
        timings["helm_scale_down_s"] = time.monotonic() - t
        report3 = rollout.wait(third.batch_id, timeout=300)
        assert_real_report(report3, 6, real_node.name)
        kc.wait_for(
            lambda: (
                len(
                    cluster.core.list_namespaced_pod(
                        ns, label_selector="app.kubernetes.io/component=collect"
                    ).items
                )
                == 1
            ),
            120,
            "the scaled-down collectors to exit",
            interval=1,
        )
        wait_deleted(rollout, third.batch_id)

        # ---- warm pools in the cluster (rbac.warmPools): attach from a worker Pod ------------
        helm_(
            "upgrade", release, str(CHART), "-n", ns, "--reset-then-reuse-values",
            "--set", "rbac.warmPools=true", "--wait", "--timeout", INSTALL_TIMEOUT,
        )  # fmt: skip
        fields = {"backend": "kubernetes", **BATCH, **real_node.batch_fields()}
        filler = rollout.submit(count=1, parallelism=1, warm_pool=2, **fields)
        assert rollout.wait(filler.batch_id, timeout=300)["successful_episodes"] == 1

        def pool_waiting():
            pods = cluster.core.list_pod_for_all_namespaces(
                label_selector="rollout.dev/pool-state=idle"
            ).items
            return len([p for p in pods if p.status.phase == "Running"]) >= 2

        kc.wait_for(pool_waiting, 120, "the warm pool to fill", interval=0.5)
        warm = rollout.submit(count=2, parallelism=2, **fields)
        assert_real_report(rollout.wait(warm.batch_id, timeout=300), 2, real_node.name)
        assert [i for i, _, _ in rollout.receipt(warm.batch_id)["run"]["warm"]] == [0, 1]
        wait_deleted(rollout, filler.batch_id)
        wait_deleted(rollout, warm.batch_id)

        def drained():
            kubectl_("-n", ns, "exec", f"deploy/{full}-control", "--", "rollout", "pools",
                     "--drain")  # fmt: skip
            return not cluster.core.list_namespace(label_selector="rollout.dev/pool").items

        kc.wait_for(drained, 120, "the warm pool to be drained", interval=1)

        # ---- uninstall: only the Redis PVC stays (README) ------------------------------------
        t = time.monotonic()
        helm_("uninstall", release, "-n", ns, "--wait", "--timeout", "5m")
        installed = False
        timings["helm_uninstall_s"] = time.monotonic() - t
        selector = f"app.kubernetes.io/instance={release}"
        kc.wait_for(
            lambda: not cluster.core.list_namespaced_pod(ns).items,
            180,
            "the release's Pods to go",
            interval=1,
        )
        left = kubectl_(
            "-n", ns, "get",
            "all,secrets,configmaps,serviceaccounts,networkpolicies,persistentvolumeclaims",
            "-o", "json",
        )  # fmt: skip
        names = sorted(
            f"{o['kind']}/{o['metadata']['name']}"
            for o in json.loads(left.stdout)["items"]
            # Kubernetes' own per-namespace objects are not the chart's.
            if o["metadata"]["name"] not in ("default", "kube-root-ca.crt")
        )
        assert names == [f"PersistentVolumeClaim/data-{full}-redis-0"], names
        rbac = client.RbacAuthorizationV1Api(cluster.api_client)
        assert not rbac.list_cluster_role(label_selector=selector).items
        assert not rbac.list_cluster_role_binding(label_selector=selector).items
        ours = {namespace_name(b.batch_id) for b in (first, second, third)}
        live = {n.metadata.name for n in cluster.core.list_namespace().items}
        assert not ours & live
    finally:
        rollout.close()
        for line in (f"{k}: {v:.1f}" for k, v in timings.items()):
            print(line)
        for key, value in timings.items():
            record_property(key, round(value, 1))
        if installed:
            subprocess.run(
                [helm, "uninstall", release, "-n", ns, "--wait", "--kubeconfig", kubeconfig],
                capture_output=True,
                timeout=600,
            )
        for name in [ns, *victims]:
            kc.delete_namespace(cluster, name)
        with contextlib.suppress(ApiException):
            cluster.core.delete_persistent_volume(storage_class)
        shutil.rmtree(data_dir, ignore_errors=True)

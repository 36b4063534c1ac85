"""Warm pools on the local cluster's real node (issue 15): a batch refills the pool of its shape
behind itself, the next batches take their first episodes from it, and every guarantee of the
cold path holds (one Pod per episode, validation, counted once, isolation, records, cleanup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from kubernetes.client import NetworkingV1Api

from rollout_wire import constants as k
from rollout_wire.request import parse_spec
from rollout_worker.backends import warm
from rollout_worker.backends.kube import objects
from rollout_worker.sandbox import episode_program_text
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

SIZE = 3


def _waiting(cluster, namespace: str) -> list:
    pods = cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{k.LABEL_POOL_STATE}={objects.POOL_STATE_IDLE}"
    ).items
    return [
        p
        for p in pods
        if p.status.phase == "Running"
        and any(c.state.running for c in p.status.container_statuses or [])
    ]


def _wait_for_pool(cluster, namespace: str, size: int) -> list:
    deadline = time.monotonic() + 120
    while len(found := _waiting(cluster, namespace)) < size:
        assert time.monotonic() < deadline, f"{len(found)} of {size} pool Pods waiting"
        time.sleep(0.5)
    return found


def _wait_cleanup(client: RolloutClient, batch_id: str) -> None:
    deadline = time.monotonic() + 180
    while client.receipt(batch_id).get("cleanup") != "deleted":
        assert time.monotonic() < deadline, client.receipt(batch_id)
        time.sleep(0.5)


def _drain(real_stack, k8s_cluster, key: str) -> None:
    """`rollout pools --drain` until the pool is drained, forgotten and its namespace gone."""
    env = {
        **os.environ,
        "ROLLOUT_REDIS_URL": real_stack.redis_url,
        "KUBECONFIG": str(k8s_cluster.kubeconfig),
    }
    deadline = time.monotonic() + 120
    while True:
        done = subprocess.run(
            [sys.executable, "-m", "rollout_worker.cli", "pools", "--drain"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        if key not in done.stdout:
            return
        assert time.monotonic() < deadline, done.stdout
        time.sleep(1)


@pytest.mark.timeout(1800)  # six batches on the real node, two pool fills, cleanups, a drain
def test_batches_take_episodes_from_the_warm_pool_with_every_cold_guarantee(
    real_node, real_stack, k8s_cluster
):
    client = RolloutClient(real_stack.redis_url)
    fields = real_node.batch_fields() | {"backend": "kubernetes"}
    key = warm.pool_key(
        parse_spec(fields | {"count": 1}, max_episodes=None), episode_program_text()
    )
    assert key is not None
    namespace = objects.pool_namespace(key)

    # A first batch finds no pool: all cold. It asks for a pool of SIZE behind it.
    first = client.submit(**fields, count=2, parallelism=2, warm_pool=SIZE)
    report = client.wait(first.batch_id, timeout=300)
    assert report["successful_episodes"] == 2, report
    assert not client.receipt(first.batch_id)["run"]["warm"]
    waiting = _wait_for_pool(k8s_cluster, namespace, SIZE)
    pool_names = {p.metadata.name for p in waiting}

    # Pool Pods are isolated like cold ones, and carry our labels.
    for pod in waiting:
        assert pod.metadata.labels[k.LABEL_OWNER] == k.LABEL_OWNER_VALUE
        assert pod.metadata.labels[k.LABEL_POOL] == key
        assert k.LABEL_BATCH not in pod.metadata.labels  # no batch owns it yet
        assert pod.spec.automount_service_account_token is False
        assert pod.spec.security_context.run_as_non_root is True
        container = pod.spec.containers[0]
        assert container.security_context.capabilities.drop == ["ALL"]
        assert container.security_context.allow_privilege_escalation is False
        assert container.stdin and container.stdin_once
        assert not container.env or not any(e.name == "ROLLOUT_ACTION" for e in container.env)
    # real_stack hands over directly (ROLLOUT_WARM_HANDOVER_FROM): each Pod listens on the
    # hand-over port with a token of its own, open to that CIDR only, beside the deny-all.
    direct = kc.handover_from(k8s_cluster)
    assert direct is not None
    tokens = {
        e.value
        for p in waiting
        for e in p.spec.containers[0].env
        if e.name == objects.HANDOVER_TOKEN_ENV
    }
    assert len(tokens) == SIZE
    policies = {
        p.metadata.name: p
        for p in NetworkingV1Api(k8s_cluster.api_client)
        .list_namespaced_network_policy(namespace)
        .items
    }
    assert sorted(policies) == ["deny-all", objects.HANDOVER_POLICY_NAME]
    deny = policies["deny-all"].spec
    assert deny.policy_types == ["Ingress", "Egress"] and not deny.egress and not deny.ingress
    opened = k8s_cluster.api_client.sanitize_for_serialization(
        policies[objects.HANDOVER_POLICY_NAME].spec
    )
    assert opened["ingress"] == [
        {
            "from": [{"ipBlock": {"cidr": direct}}],
            "ports": [{"protocol": "TCP", "port": objects.HANDOVER_PORT}],
        }
    ]

    # The next batch takes SIZE episodes from the pool and runs the rest cold.
    second = client.submit(**fields, count=SIZE + 1, parallelism=SIZE + 1)
    report = client.wait(second.batch_id, timeout=300)
    run = client.receipt(second.batch_id)["run"]
    assert [index for index, _, _ in run["warm"]] == list(range(SIZE))
    assert {name for _, name, _ in run["warm"]} == pool_names
    assert report["episodes"] == SIZE + 1 and report["successful_episodes"] == SIZE + 1, report
    rows = {row["index"]: row for row in report["pods"]}
    assert sorted(rows) == list(range(SIZE + 1))  # each episode counted once
    for index, name, _uid in run["warm"]:
        row = rows[index]
        assert row["pod"] == name and row["reward"] == 1, row
        # The sandbox became this episode at its claim, after the run's origin; its own Pod
        # is older (it waited in the pool).
        assert row["timing"]["pool_created_at"] < row["created_at"] <= row["ready_at"]
        assert 0 < row["timing"]["handover_seconds"] < 5, row
        log = client.redis.hget(k.logs_key(second.batch_id), str(index)).decode()
        events = [json.loads(line) for line in log.splitlines() if line.strip()]
        assert [e["event"] for e in events] == ["ready", "reward"]
        assert all(e["episode_id"] == name for e in events)
    assert rows[SIZE]["pod"] not in pool_names and "handover_seconds" not in rows[SIZE]["timing"]
    # Every one went directly: a failed direct hand-over logs its fall back to attach.
    logs = "".join(p.read_text(errors="replace") for p in real_stack.dir.glob("worker-*.log"))
    assert "handing over by attach" not in logs
    deadline = time.monotonic() + 60
    while client.receipt(second.batch_id).get("records") != "complete":
        assert time.monotonic() < deadline, client.receipt(second.batch_id)
        time.sleep(0.2)
    pods_record = json.loads(client.redis.hget(k.artifacts_key(second.batch_id), "pods.json"))
    assert pool_names <= {p["metadata"]["name"] for p in pods_record}

    # Cleanup deletes the batch's warm Pods (proved by UID and batch label) with its namespace.
    _wait_cleanup(client, second.batch_id)
    left = k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{k.LABEL_BATCH}={second.batch_id}"
    ).items
    assert not [p.metadata.name for p in left if not p.metadata.deletion_timestamp]

    # Two batches at once, one refill: a pool Pod goes to exactly one batch. The pool holds
    # SIZE waiting Pods (the second batch took the first fill whole, the third ran cold and
    # refilled it) and each racing batch lists them and claims up to SIZE: every Pod is
    # claimed, by one of them only (the loser of a claim runs that episode cold).
    third = client.submit(**fields, count=1, parallelism=1, warm_pool=SIZE)
    client.wait(third.batch_id, timeout=300)
    racing_pool = {p.metadata.name for p in _wait_for_pool(k8s_cluster, namespace, SIZE)}
    assert len(racing_pool) == SIZE, racing_pool
    racing = [client.submit(**fields, count=SIZE, parallelism=SIZE) for _ in range(2)]
    reports = [client.wait(s.batch_id, timeout=300) for s in racing]
    assert all(r["successful_episodes"] == SIZE for r in reports), reports
    taken = [name for s in racing for _, name, _ in client.receipt(s.batch_id)["run"]["warm"]]
    assert sorted(taken) == sorted(racing_pool), taken

    # Draining on demand empties the pool and deletes its namespace (registry UID + labels).
    for s in (first, third, *racing):
        _wait_cleanup(client, s.batch_id)
    _drain(real_stack, k8s_cluster, key)
    assert not any(ns.metadata.name == namespace for ns in k8s_cluster.core.list_namespace().items)
    client.close()


@pytest.mark.parametrize("handover", ["attach", "direct"])
def test_a_redelivered_start_takes_the_same_warm_pods_and_cancel_stops_them(
    real_node, k8s_cluster, handover
):
    """In-process (no workers): the backend's own start_run run twice, as a redelivered submit
    would, then cancel_run and delete_run. With "attach" the hand-over goes through the API
    server only (the other tests here use real_stack, which hands over directly)."""
    from rollout_worker.backends.kube.backend import KubernetesBackend
    from rollout_worker.settings import Settings

    direct = kc.handover_from(k8s_cluster) if handover == "direct" else None
    assert direct or handover == "attach"
    settings = Settings(kubeconfig=str(k8s_cluster.kubeconfig), warm_handover_from=direct)
    backend = KubernetesBackend(settings)
    fields = real_node.batch_fields() | {"backend": "kubernetes"}
    spec = parse_spec(fields | {"count": 2, "action": "hang"}, max_episodes=None)
    key = backend.pool_key(spec)
    assert key is not None
    namespace = objects.pool_namespace(key)
    registry: dict = {}
    backend.fill_pool(spec, 2, 64, 600, registry.update)
    _wait_for_pool(k8s_cluster, namespace, 2)
    receipt: list[dict] = []
    first = backend.start_run(spec, lambda fields: receipt.append(dict(fields)))
    again = backend.start_run(spec, lambda fields: receipt.append(dict(fields)))
    assert first.warm == again.warm and [c.index for c in first.warm] == [0, 1]
    assert not first.job_uids()  # every episode warm: no Job at all
    # The receipt named the Pods before the first patch, then what was claimed.
    names = [list(entry) for entry in receipt]
    assert names.index(["pool_namespace", "warm_planned"]) < names.index(["warm"])
    for index in (0, 1):
        obs = backend.wait_episode(first, index, 2)  # the watch syncs; it stays Running
        assert obs.phase == "Running" and obs.episode_id == first.warm[index].pod
        assert obs.ready is False  # progress "ready" never comes from a warm Pod's status
        kc.wait_for(lambda o=obs: '"ready"' in backend.read_output(first, o), 10, "ready")
    backend.cancel_run(first)  # a deadline that has passed: the kubelet stops them
    for index in (0, 1):
        obs = backend.wait_episode(first, index, 60)
        assert obs.phase == "Failed" and "DeadlineExceeded" in (obs.reason or ""), obs
        log = backend.read_output(first, obs)
        # Handed over twice, run once: the runner reads one line.
        assert [json.loads(x)["event"] for x in log.splitlines() if x.strip()] == ["ready"]
    deadline = time.monotonic() + 120
    while not backend.delete_run(first):
        assert time.monotonic() < deadline
        time.sleep(1)
    assert not k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{k.LABEL_BATCH}={spec.batch_id}"
    ).items
    while not backend.drain_pool(key, registry["uid"]):
        assert time.monotonic() < deadline
        time.sleep(1)


def _idle_pods(cluster, namespace: str) -> list:
    return cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{k.LABEL_POOL_STATE}={objects.POOL_STATE_IDLE}"
    ).items


@pytest.mark.timeout(900)
def test_a_batch_of_several_waves_is_fed_from_its_pool_and_a_drained_pool_runs_cold(
    real_node, real_stack, k8s_cluster
):
    """Issue 26: more episodes than slots, a pool of the batch's shape: no Job; each freed
    slot is given a waiting Pod, the pool is refilled while the batch runs, and every cold
    guarantee holds (one Pod per episode, counted once, records, cleanup). A pool with nothing
    waiting leaves the batch to the cold path whole."""
    client = RolloutClient(real_stack.redis_url)
    fields = real_node.batch_fields() | {"backend": "kubernetes"}
    slots, count = 2, 7
    key = warm.pool_key(
        parse_spec(fields | {"count": 1}, max_episodes=None), episode_program_text()
    )
    assert key is not None
    namespace = objects.pool_namespace(key)
    first = client.submit(**fields, count=1, parallelism=1, warm_pool=slots)
    assert client.wait(first.batch_id, timeout=300)["successful_episodes"] == 1
    filled = {p.metadata.name for p in _wait_for_pool(k8s_cluster, namespace, slots)}

    batch = client.submit(**fields, count=count, parallelism=slots)
    report = client.wait(batch.batch_id, timeout=300)
    receipt = client.receipt(batch.batch_id)
    run = receipt["run"]
    assert run["fed"] is True and not run["jobs"] and run["job_uid"] is None, run
    assert report["successful_episodes"] == count, report
    assert sorted(index for index, _, _ in run["warm"]) == list(range(count))
    names = {name for _, name, _ in run["warm"]}
    assert len(names) == count  # one Pod per episode, never reused
    assert filled <= names and len(names - filled) == count - slots  # refilled as it ran
    # Every Pod the feeder claimed was named in the receipt (with its UID) before its claim.
    planned = receipt["feed_planned"]
    for index, name, uid in run["warm"]:
        if name not in filled:
            assert planned[str(index)] == [name, uid]
    rows = {row["index"]: row for row in report["pods"]}
    assert sorted(rows) == list(range(count))  # each episode counted once
    for index, name, _uid in run["warm"]:
        row = rows[index]
        assert row["pod"] == name and row["reward"] == 1, row
        assert row["timing"]["pool_created_at"] < row["created_at"] <= row["ready_at"]
    # Never more than `slots` episodes at once (a claim waits for a freed slot).
    spans = [(row["created_at"], row["finished_at"]) for row in rows.values()]
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= slots, spans
    deadline = time.monotonic() + 60
    while client.receipt(batch.batch_id).get("records") != "complete":
        assert time.monotonic() < deadline, client.receipt(batch.batch_id)
        time.sleep(0.2)
    pods_record = json.loads(client.redis.hget(k.artifacts_key(batch.batch_id), "pods.json"))
    assert names <= {p["metadata"]["name"] for p in pods_record}
    _wait_cleanup(client, batch.batch_id)
    left = k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{k.LABEL_BATCH}={batch.batch_id}"
    ).items
    assert not [p.metadata.name for p in left if not p.metadata.deletion_timestamp]

    # Drained: the pool's namespace is there but nothing waits in it. The batch runs cold
    # (one Job), with no warm episode.
    for pod in _idle_pods(k8s_cluster, namespace):
        k8s_cluster.core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    deadline = time.monotonic() + 60
    while _idle_pods(k8s_cluster, namespace):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    cold = client.submit(**fields, count=3, parallelism=slots)
    report = client.wait(cold.batch_id, timeout=300)
    run = client.receipt(cold.batch_id)["run"]
    assert not run["fed"] and not run["warm"] and run["jobs"], run
    assert report["successful_episodes"] == 3, report
    assert not [row for row in report["pods"] if "pool_created_at" in row["timing"]]
    for s in (first, cold):
        _wait_cleanup(client, s.batch_id)
    _drain(real_stack, k8s_cluster, key)
    client.close()


@pytest.mark.timeout(900)
def test_warm_pods_serve_episodes_with_hidden_tests_that_only_their_runner_holds(
    real_node, real_stack, k8s_cluster
):
    # A task in its own image grades in its agent's container: a warm Pod takes such an
    # episode, its tests handed over apart from the task and kept in the runner's memory. An
    # agent that searches its whole Pod for them finds nothing, cold or warm.
    from pathlib import Path

    from rollout_wire.tasksets import load_task_set
    from tests.red_team import look_for

    harbor = Path(__file__).resolve().parents[1] / "data" / "harbor"
    subprocess.run(["hack/docker-up.sh"], check=True, cwd=harbor.parents[2], timeout=600)
    built = subprocess.run(
        [
            *(sys.executable, "-m", "rollout_worker.cli", "tasks", "build", str(harbor)),
            *("--task", "image-task", "--node-import"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (task,) = load_task_set(str(harbor), ["image-task"])
    # A pool's Pods work in /workspace, so a task's workdir (here the Dockerfile's WORKDIR)
    # refuses a warm pool; this task's solution and tests name /app by absolute path.
    task = {name: value for name, value in task.items() if name != "workdir"}
    look = {"command": ["python", "-c", look_for("from greet import ", "greeting")]}
    fields = real_node.batch_fields() | {
        "backend": "kubernetes",
        "tasks": [task | {"agent": "oracle"}, task | {"id": "look", "agent": look}],
        "policy": {"url": "http://127.0.0.1:9"},  # never asked
        "capacity_check": "warn",
    }
    spec = parse_spec(fields, max_episodes=None)
    key = warm.pool_key(spec, episode_program_text(), grades_within=True)
    assert key is not None and warm.pool_key(spec, episode_program_text()) is None
    client = RolloutClient(real_stack.redis_url)
    try:
        first = client.submit(**fields, warm_pool=2)
        reports = [client.wait(first.batch_id, timeout=300)]
        assert not client.receipt(first.batch_id)["run"]["warm"]
        waiting = _wait_for_pool(k8s_cluster, objects.pool_namespace(key), 2)
        assert all(not p.spec.init_containers for p in waiting)  # no stash in a warm Pod
        second = client.submit(**fields)
        reports.append(client.wait(second.batch_id, timeout=300))
        assert len(client.receipt(second.batch_id)["run"]["warm"]) == 2
        # A batch of warm Pods alone completes too (the guide's client_job_complete_seconds).
        deadline = time.monotonic() + 60
        while not client.receipt(second.batch_id).get("completed_at"):
            receipt = client.receipt(second.batch_id)
            assert time.monotonic() < deadline, {
                k: receipt.get(k) for k in ("records", "records_error", "run_verdict", "cleanup")
            }
            time.sleep(0.5)
        for report in reports:
            rows = {row["task_id"]: row for row in report["pods"]}
            assert {t: r["reward"] for t, r in rows.items()} == {"image-task": 1, "look": 0}
            found = rows["look"]["agent_output"]
            assert "hidden tests found: none" in found, found
    finally:
        client.close()
        _drain(real_stack, k8s_cluster, key)

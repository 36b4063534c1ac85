"""Sandbox hosts on the real node keep the per-Pod path's guarantees (issue 46): one pool of
2 host Pods x 2 slots (the agent as rollout_worker/backends/host/manifests.py runs it), one
stack reached at the node's address, one scripted policy (and one whose every turn takes 2 s),
and a batch per guarantee: records reach `rollout run --output`, an exit 4 is retried and
counted once, a quota met and `rollout cancel` stop what runs and free the slots, a hung
episode ends DeadlineExceeded with its sandbox gone, a host killed mid-batch with a retry
budget loses nothing (its episodes run again elsewhere, the batch's keys and folders go after
its cleanup), and a host killed without a retry budget ends its episode HostLost.

Every outcome checked is written by the parts under test: the report and rows by the workers,
the heartbeats by the agents, the records by the CLI, the processes counted in the Pods."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from rollout_wire import constants as k
from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.host import manifests
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.cli.policy_server import PolicyServer, bundled_script, running
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

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

# The slow task's one turn waits this long: far past every wait below, so only the service
# (a quota, a cancel, a lost host) ends its episodes.
SLOW_SECONDS = 120
SLOW_TASK = "clamp-range"
FAST_TASK = "stack-pop"
# shipping-boundary's sample 0 gets a 503 on attempt 0's first turn (exit 4, no retry inside
# the runner); its retry and sample 1 follow the bundled plan.
OUTAGE_TASK = "shipping-boundary"
# The hung batch: one slot, so episode 0 hangs until its own timeout and episode 1, taken
# when 0 ends (about EPISODE_TIMEOUT in), hangs until the batch deadline, well before its own.
EPISODE_TIMEOUT = 5
DEADLINE = 9
# Hosts stamp the times; the Celery side stamps the run's start: same node clock, plus how
# long a host takes to see a limit pass and kill (its loop wakes at each deadline).
SLACK = 3.0
# The agents' lease: how long a killed host keeps its episode before a collector may end it
# HostLost (the default 15 s would only make the last test wait longer). Renewed every
# 5/3 s, so a live host keeps its leases through a few slow renewals.
LEASE_SECONDS = 5
# The collectors' block (default 15 s), as the KWOK stacks run it: a lost host's episode ends at
# most this long after its lease is gone.
COLLECT_BLOCK_SECONDS = 2

# Run in a host Pod (its PID namespace is the Pod's: shareProcessNamespace): how many sandboxes
# run, one per bwrap process whose parent is no bwrap (bwrap forks its namespace's init from
# itself, with the same command line).
SANDBOXES = """\
import os
found = {}
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        argv0 = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')[0]
        parent = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        continue
    if argv0.endswith(b'bwrap'):
        found[int(pid)] = parent
print(sum(1 for parent in found.values() if parent not in found))
"""


def script() -> dict:
    found = copy.deepcopy(bundled_script())
    right = found["tasks"][OUTAGE_TASK]["plans"][0]
    outage = [{**right[0], "unavailable_on_attempts": [0]}, *right[1:]]
    found["tasks"][OUTAGE_TASK]["plans"] = [outage, right]
    slow = [{"tool": "submit", "arguments": {}, "delay": SLOW_SECONDS}]
    found["tasks"][SLOW_TASK] = {"plans": [slow]}
    return found


@dataclass
class Hosts:
    cluster: kc.Cluster
    namespace: str
    pool: manifests.HostPool
    stack: LocalStack
    server: PolicyServer
    queue: HostQueue
    client: RolloutClient
    policy_url: str
    # The bundled plans, every turn 2 s (the killed-host batch).
    paced: PolicyServer
    paced_url: str

    def names(self) -> set[str]:
        return set(pool_pods(self.cluster, self.pool))

    def idle(self, timeout: float = 30) -> dict[str, dict]:
        """Until every host Pod heartbeats with all its slots free (what the agents say)."""
        names = self.names()
        return wait_hosts(self.queue, names, len(names), timeout)

    def sandboxes(self, pods: set[str] | None = None) -> dict[str, int]:
        """Sandboxes running in each host Pod, counted in the Pod."""
        return {
            pod: int(kubectl_exec(self.cluster, self.namespace, pod, "python3", "-c", SANDBOXES))
            for pod in sorted(pods or self.names())
        }

    def freed(self, batch: str) -> None:
        """The batch holds no slot: every host heartbeats all slots free and without it, and
        no sandbox runs in any host Pod."""
        for name, info in self.idle(15).items():
            assert batch not in (info.get("batches") or []), (name, info)
        kc.wait_for(
            lambda: not any(self.sandboxes().values()), 15, "no sandbox in any host", interval=1
        )

    def policy(self, **fields: Any) -> dict[str, Any]:
        return {"url": self.policy_url, "request_timeout_seconds": 10, "max_retries": 0} | fields

    def submit(self, **fields: Any) -> str:
        request = {"backend": "kubernetes", "isolation": "host"} | fields
        return self.client.submit(**request).batch_id

    def follow(self, batch: str, timeout: float) -> tuple[dict, Counter]:
        """The batch's stream until its report: the report and the episode entries per index."""
        entries: Counter = Counter()
        for _, entry in self.client.entries([batch], timeout=timeout):
            if entry.row is not None:
                entries[entry.index] += 1
        report = self.client.report(batch)
        assert report is not None, f"stream of {batch} ended without a stored report"
        return report, entries


@pytest.fixture(scope="module")
def hosts(k8s_cluster, real_node, host_image) -> Iterator[Hosts]:
    """One pool for every test here: the tests run in file order, the two that kill a host
    last."""
    namespace = kc.create_test_namespace(k8s_cluster, "host-guarantees")
    address = node_address(k8s_cluster, real_node)
    env = {
        "KUBECONFIG": str(k8s_cluster.kubeconfig),
        # A collector looks again every COLLECT_BLOCK_SECONDS when its episode has not ended;
        # that look is what ends a killed host's episodes once their lease is gone.
        "ROLLOUT_COLLECT_BLOCK_SECONDS": str(COLLECT_BLOCK_SECONDS),
    }
    try:
        with (
            LocalStack(
                collectors=2, extra_env=env, redis_bind=address, password=uuid.uuid4().hex
            ) as stack,
            running(host="0.0.0.0", script=script()) as server,
            running(host="0.0.0.0", turn_seconds=2.0) as paced,
        ):
            stack.wait_ready()
            endpoints = tuple(manifests.Endpoint(f"{address}/32", s.port) for s in (server, paced))
            url = stack.redis_url_at(address)
            pool = host_pool(real_node, namespace, host_image, url, policy_egress=endpoints)
            create_pool(k8s_cluster, with_lease(manifests.host_objects(pool), LEASE_SECONDS))
            queue = HostQueue(redis.Redis.from_url(stack.redis_url))
            client = RolloutClient(stack.redis_url)
            found = Hosts(
                k8s_cluster,
                namespace,
                pool,
                stack,
                server,
                queue,
                client,
                f"http://{address}:{server.port}",
                paced,
                f"http://{address}:{paced.port}",
            )
            wait_hosts(queue, None, 2, 180)
            yield found
            client.close()
    finally:
        kc.delete_namespace(k8s_cluster, namespace)


def rollout(hosts: Hosts, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollout_worker.cli", *args, "--redis-url", hosts.stack.redis_url],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "KUBECONFIG": str(hosts.cluster.kubeconfig)},
    )


def test_a_host_batchs_records_reach_rollout_run_output(hosts, tmp_path):
    hosts.idle()
    out = tmp_path / "records"
    done = rollout(
        hosts,
        *("run", "--backend", "kubernetes", "--isolation", "host"),
        *("--tasks", "bundled", "--task", FAST_TASK, "--samples", "2"),
        *("--policy-url", hosts.policy_url, "--policy-timeout", "10"),
        *("--output", str(out), "--no-keep", "--json", "--timeout", "120"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["batch_id"] == json.loads(done.stdout)["batch_id"]
    assert results["run_isolation"] == "host"
    rows = sorted(results["pods"], key=lambda r: r["index"])
    assert [(r["index"], r["status"]) for r in rows] == [(0, "ok"), (1, "ok")], results["errors"]
    assert {r["node"] for r in rows} <= hosts.names(), rows
    for row in rows:
        # Each episode's log as its host sent it: the runner's events, under its episode id.
        log = (out / f"{row['pod']}.log").read_text()
        assert '"event": "ready"' in log and row["pod"] in log, log[-2000:]
    # The backend's own record of where each episode ran, written with the run's records.
    placed = json.loads((out / "hosts.json").read_text())
    assert {int(i): p["host"] for i, p in placed.items()} == {r["index"]: r["node"] for r in rows}
    assert all(p["attempts"] == [] for p in placed.values()), placed
    assert json.loads((out / "receipt.json").read_text())["state"] == "reported"


def test_an_exit_4_on_a_host_is_retried_in_a_fresh_sandbox_and_counted_once(hosts):
    hosts.idle()
    batch = hosts.submit(
        tasks=load_task_set("bundled", only=[OUTAGE_TASK]),
        samples_per_task=2,
        parallelism=2,
        infra_retries=1,
        policy=hosts.policy(),
    )
    report, entries = hosts.follow(batch, 120)
    assert dict(entries) == {0: 1, 1: 1}, f"stream entries per index {entries}"
    rows = {r["sample"]: r for r in report["pods"]}
    retried, plain = rows[0], rows[1]
    assert (retried["status"], retried["reward"]) == ("ok", 1), retried["errors"]
    (first,) = retried["retried"]
    assert first["exit_code"] == 4 and "503" in (first["cause"] or ""), first
    assert first["episode_id"] != retried["pod"] and retried["pod"].endswith("-retry1")
    assert retried["node"] in hosts.names(), retried
    assert (plain["status"], plain["reward"], plain["retried"]) == ("ok", 1, []), plain
    assert report["successful_episodes"] == 2 and report["reward_sum"] == 2
    assert (report["retried_episodes"], report["retries"]) == (1, 1)
    assert report["infrastructure_failures"] == 0 and report["lost_episodes"] == 0
    # The policy was asked by each attempt under its own episode id and attempt number.
    seen = {(c["episode_id"], c["attempt"]) for c in hosts.server.calls()}
    assert {(first["episode_id"], 0), (retried["pod"], 1)} <= seen
    # The failed attempt's log is a record of the run, the runner's error in it.
    name = f"episode-{retried['index']}.attempt0.log"
    log = kc.wait_for(lambda: hosts.client.records(batch).get(name), 60, f"record {name}")
    assert '"event": "error"' in log, log[-2000:]


def test_a_quota_met_aborts_the_host_episodes_left_and_frees_their_slots(hosts):
    hosts.idle()
    batch = hosts.submit(
        tasks=load_task_set("bundled", only=[FAST_TASK, SLOW_TASK]),
        samples_per_task=1,
        parallelism=2,
        groups_wanted=1,
        policy=hosts.policy(request_timeout_seconds=SLOW_SECONDS + 30),
    )
    report, entries = hosts.follow(batch, 90)
    assert report["status"] == "succeeded", report["errors"]
    assert dict(entries) == {0: 1, 1: 1}, f"stream entries per index {entries}"
    assert [g.split(":")[1] for g in report["quota"]["counted"]] == [FAST_TASK]
    rows = {r["task_id"]: r for r in report["pods"]}
    assert rows[FAST_TASK]["status"] == "ok", rows[FAST_TASK]["errors"]
    aborted = rows[SLOW_TASK]
    assert aborted["status"] == "aborted", aborted
    assert aborted["reward"] == 0 and aborted["failure_kind"] is None, aborted
    # It was running on a host when the quota stopped it (its first turn still waiting).
    assert aborted["node"] in hosts.names(), aborted
    assert report["aborted_episodes"] == 1 and report["failed_episodes"] == 0
    hosts.freed(batch)


def test_rollout_cancel_stops_the_host_episodes_and_frees_their_slots(hosts):
    hosts.idle()
    batch = hosts.submit(
        tasks=load_task_set("bundled", only=[SLOW_TASK]),
        samples_per_task=2,
        parallelism=2,
        policy=hosts.policy(request_timeout_seconds=SLOW_SECONDS + 30),
    )
    kc.wait_for(lambda: len(hosts.queue.taken(batch)) == 2, 60, "both episodes on hosts")
    kc.wait_for(
        lambda: sum(hosts.sandboxes().values()) == 2, 30, "their two sandboxes", interval=0.5
    )
    done = rollout(hosts, "cancel", batch, "--timeout", "60", timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join(done.stdout.split())  # the console wraps at 80 columns
    assert f"batch {batch}: cancelled, 0 of 2 episodes had finished ok" in said, said
    report = hosts.client.report(batch)
    assert report is not None and report["status"] == "cancelled", report
    assert report["ok"] is False and report["successful_episodes"] == 0
    # As a cancel on the other backends: stopped before they finished, counted lost.
    assert report["lost_episodes"] == 2 and report["collected_episodes"] == 2, report["errors"]
    rows = sorted(report["pods"], key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [0, 1]
    for row in rows:
        assert row["reward"] == 0 and row["reward_at"] is None, row
        assert any("cancelled" in error for error in row["errors"]), row
        assert row["node"] in hosts.names(), row
    hosts.freed(batch)


def test_a_hung_episode_on_a_host_ends_deadline_exceeded_and_its_sandbox_goes(hosts):
    hosts.idle()
    batch = hosts.submit(
        count=2,
        parallelism=1,
        action="hang",
        episode_timeout_seconds=EPISODE_TIMEOUT,
        deadline_seconds=DEADLINE,
    )
    report, entries = hosts.follow(batch, DEADLINE + 60)
    assert dict(entries) == {0: 1, 1: 1}, f"stream entries per index {entries}"
    assert report["ok"] is False and report["successful_episodes"] == 0
    rows = sorted(report["pods"], key=lambda r: r["index"])
    names = hosts.names()
    for row in rows:
        assert row["status"] in ("failed", "lost") and row["reward"] == 0, row
        assert row["reward_at"] is None, row
        assert "DeadlineExceeded" in "; ".join(row["errors"]), row
        # It really ran on a host, and hung there: ready, never rewarded.
        assert row["node"] in names and row["ready_at"] is not None, row
    timed_out, cut = rows
    # Episode 0 ended at its own timeout, before the batch deadline.
    ran = timed_out["finished_at"] - timed_out["created_at"]
    assert EPISODE_TIMEOUT - 0.5 <= ran <= EPISODE_TIMEOUT + SLACK, (ran, timed_out)
    # Episode 1 ended at the batch deadline, before its own timeout.
    ended = cut["finished_at"] - report["run_created_at"]
    assert DEADLINE - 0.5 <= ended <= DEADLINE + SLACK, (ended, cut)
    assert cut["finished_at"] - cut["created_at"] < EPISODE_TIMEOUT - 0.5, cut
    hosts.freed(batch)


def test_hosts_run_a_batch_once_each_and_lose_nothing_to_a_killed_host(hosts):
    """The bundled tasks x 2 (`isolation: host`, 2 hosts x 2 slots): every row once, each on a
    host Pod; one host killed (grace 0) mid-batch loses nothing (infra_retries=1: its episodes
    run again elsewhere, `retried` says HostLost); after the run's cleanup no key of the batch
    is left, nor its folder in any host. Next to last: it kills one of the pool's Pods (its
    Deployment makes another)."""
    hosts.idle()
    names = hosts.names()
    assert set(hosts.queue.hosts()) == names, (hosts.queue.hosts(), names)
    queue, client = hosts.queue, hosts.client
    tasks = load_task_set("bundled")
    started = time.monotonic()
    submission = client.submit(
        backend="kubernetes",
        isolation="host",
        tasks=tasks,
        samples_per_task=2,
        parallelism=4,
        infra_retries=1,
        # Each turn takes 2 s: episodes outlast the kubelet's 2 s kill of a force-deleted Pod
        # (SIGTERM lets the agent drain only that long), so the killed host loses some.
        policy={"url": hosts.paced_url, "request_timeout_seconds": 10},
    )
    batch = submission.batch_id
    count = len(tasks) * 2

    # Kill the host that holds the most running episodes, once it holds one.
    def busy_host():
        taken = queue.taken(batch)
        return max(set(taken.values()), key=list(taken.values()).count) if taken else None

    victim = kc.wait_for(busy_host, 60, "a host to take an episode", interval=0.1)
    lost = {i for i, host in queue.taken(batch).items() if host == victim}
    hosts.cluster.core.delete_namespaced_pod(victim, hosts.namespace, grace_period_seconds=0)
    report = client.wait(batch, timeout=240)
    elapsed = time.monotonic() - started
    print(f"{count} episodes on 2 hosts x 2 slots, one host killed: {elapsed:.1f}s")

    assert report["ok"], report["errors"]
    assert report["run_isolation"] == "host"
    rows = report["pods"]
    assert sorted(r["index"] for r in rows) == list(range(count))  # every row, once
    assert len({r["pod"] for r in rows}) == count  # each its own sandbox
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    hosts_now = hosts.names()
    assert {r["node"] for r in rows} <= names | hosts_now, {r["node"] for r in rows}
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

    kc.wait_for(lambda: client.receipt(batch).get("cleanup") == "deleted", 120, "the run's cleanup")
    # The run is gone (its rows and report stay, as every backend's records do).
    leftover = list(queue.redis.scan_iter(k.host_batch_key(batch, "*")))
    assert leftover == [], leftover
    assert batch not in queue.runs()
    assert not [i for i in queue.redis.lrange(k.HOSTS_TODO_KEY, 0, -1) if batch in str(i)]
    live = hosts.names()
    for pod in live:
        # A host drops a batch's folder at its next look once the run is gone.
        def gone(pod=pod):
            ls = kubectl_exec(hosts.cluster, hosts.namespace, pod, "ls", manifests.HOST_ROOT)
            return batch not in ls.split()

        kc.wait_for(gone, 30, f"{pod} to remove its folder of {batch}", interval=1)
    for name, info in wait_hosts(queue, live, len(live), 30).items():
        assert not info.get("batches"), (name, info)


def test_without_retries_a_host_killed_mid_episode_ends_it_host_lost(hosts):
    """Last: it kills one of the pool's Pods."""
    # The test before killed a host: its replacement may still be starting.
    hosts.idle(120)
    before = {c["episode_id"] for c in hosts.server.calls()}
    batch = hosts.submit(
        tasks=load_task_set("bundled", only=[SLOW_TASK]),
        samples_per_task=1,
        infra_retries=0,
        policy=hosts.policy(request_timeout_seconds=SLOW_SECONDS + 30),
    )
    taken = kc.wait_for(lambda: hosts.queue.taken(batch), 60, "the episode on a host")
    (victim,) = taken.values()
    kc.wait_for(
        lambda: hosts.sandboxes({victim})[victim] == 1, 30, "its sandbox running", interval=0.5
    )
    # Mid-episode: its first turn is with the policy (for SLOW_SECONDS).
    kc.wait_for(
        lambda: {c["episode_id"] for c in hosts.server.calls()} - before,
        30,
        "its first policy call",
    )
    hosts.cluster.core.delete_namespaced_pod(victim, hosts.namespace, grace_period_seconds=0)
    # Its lease (LEASE_SECONDS) expires, then a collector's next look (within
    # COLLECT_BLOCK_SECONDS) ends it.
    report, entries = hosts.follow(batch, 90)
    assert dict(entries) == {0: 1}, f"stream entries per index {entries}"
    (row,) = report["pods"]
    assert row["status"] in ("failed", "lost") and row["node"] == victim, row
    assert row["reward"] == 0 and row["reward_at"] is None, row
    assert row["failure_kind"] == "infrastructure", row
    assert "HostLost" in "; ".join(row["errors"]), row
    assert row["retried"] == [] and report["retries"] == 0, row  # not run again
    # Nothing ran it again: the policy saw one attempt of it, attempt 0.
    attempts = {c["attempt"] for c in hosts.server.calls() if c["episode_id"] == row["pod"]}
    assert attempts == {0}, attempts

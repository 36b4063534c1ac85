"""Over-sampling and continuous sampling against a slow tail, side by side in one run.

The scripted policy answers every turn after --turn-seconds; a tenth of the samples are slow
(each of their turns waits 10 x as long), picked by a hash of (group id, sample), so every batch
draws another random set. Tasks: the bundled set, `palindrome` included (the policy server
runs without `hangs`, so its scripted hang is an immediate submit: a one-turn group of reward
0, no timeout waited out). K = the number of tasks (9), S = --samples per task.

1. Time to K complete groups. Plain: a batch of K groups (K tasks x S) that runs every episode;
   submit -> report. Over-sampled: ceil(1.25 K) groups with groups_wanted=K, group_filter=any;
   submit -> the K-th counted `group` entry (what a trainer waits for), and submit -> report
   (after the cut episodes' aborts are confirmed). A batch holds each task id once, so the
   extra groups are copies of bundled tasks under new ids (`<id>.2`; the policy acts on a copy
   as on its original), a different third of the set each round. Local: every episode of a
   batch at once. Real node: as many as the node has room for (the workers' own capacity
   arithmetic), printed. Goal: over-sampled time to K <= 0.5 x plain.
2. Continuous vs synchronous, local only: G = 2K groups, N = K in flight. Synchronous: rounds
   of N groups, each submitted after the previous report (start -> last report). Continuous:
   the trainer client's continuous sampler, groups_in_flight=N, total_groups=G (start -> G-th
   group). Groups per second of each and the ratio. Goal: continuous >= 1.8 x synchronous.
3. Group entry latency: for every `group` entry of every batch above, its stream id (the
   Redis server's ms clock) minus that of the last `episode` entry among the group's samples.
   Median and p95. Goal: median <= 0.1 s.

Each round runs both sides of a comparison, alternating which goes first; figures are the
median [min-max] over --rounds rounds, ratios taken round by round. Between timed batches the
earlier batches' reports and run cleanups are waited for (not timed). Each backend gets its own
stack (redis-server, a control worker, two collectors), its own policy server and one unmeasured
warm-up batch. Every round's numbers, with the slow samples each batch drew (with K x S samples
none at all has a small, real chance), are printed and written to --out as JSON lines.

--backends kubernetes|both needs a cluster with the real node, found or started as the tests
do (`KUBECONFIG`, else hack/localkube's `cluster.sh up` and `node-up`); without one the
benchmark exits with the reason before measuring anything.

    python -m benchmarks.bench_tail [--rounds 3] [--samples 4] [--turn-seconds 0.5]
        [--backends local|kubernetes|both] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from kubernetes import client as kube_client

from benchmarks.harness import new_parser
from benchmarks.tail_table import LABELS, print_table
from rollout_wire import constants as k
from rollout_wire.codec import decode_entry
from rollout_wire.request import DEFAULT_TASK_TIME_LIMIT_SECONDS, BatchSpec, parse_spec
from rollout_wire.states import BatchStatus, Cleanup, GroupFilter
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.backends.kube.read import capacity_plan
from rollout_worker.cli.policy_server import ScriptedPolicy, bundled_script, running
from rollout_worker.cli.stack import LocalStack
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient
from trainer_stub.sampling import ContinuousSampler

SLOW_FRACTION = 0.1
SLOW_FACTOR = 10.0
OVER_SAMPLING = 1.25
SETTLE_SECONDS = 300.0  # a run's cleanup (a namespace's deletion on the real node) takes this
NEVER_RAN = (BatchStatus.REJECTED, BatchStatus.ERROR, BatchStatus.HALTED)
BACKENDS = {"local": ["local"], "kubernetes": ["kubernetes"], "both": ["local", "kubernetes"]}


def copy_id(task_id: str) -> str:
    return f"{task_id}.2"


def prepare(turn_seconds: float) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """The bundled tasks, the policy's script (with each task's plans also under its copy's id)
    and the episode timeout. A task's agent time limit is raised where its plan, every turn
    slow, could reach it: the tail must end by itself, never at a limit."""
    script = bundled_script()
    plans = script["tasks"]
    slow_turn = turn_seconds * SLOW_FACTOR
    tasks = []
    for task in bundled_tasks():
        mine = (plans.get(task["id"]) or {}).get("plans") or [[]]
        # Past its plan the policy submits: one turn more than the plan has.
        worst = max(sum(slow_turn + float(t.get("delay", 0)) for t in p) + slow_turn for p in mine)
        # Setup and tests on a loaded 2-core machine on top.
        limit = max(task.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS), worst + 30)
        tasks.append(task | {"time_limit_seconds": math.ceil(limit)})
        if task["id"] in plans:
            plans[copy_id(task["id"])] = plans[task["id"]]
    episode_timeout = max(t["time_limit_seconds"] for t in tasks) + 60
    return tasks, script, episode_timeout


def copies(tasks: list[dict[str, Any]], count: int, offset: int) -> list[dict[str, Any]]:
    """`count` tasks under their copies' ids, from `offset` on (cycling)."""
    picked = [tasks[(offset + i) % len(tasks)] for i in range(count)]
    return [t | {"id": copy_id(t["id"])} for t in picked]


def group_latencies(client: RolloutClient, batch_id: str) -> list[float]:
    """Seconds from the last `episode` entry of a group's samples to its `group` entry, for
    every group entry of the batch's stream (ids are the Redis server's ms clock)."""
    episode_ms: dict[int, int] = {}
    found = []
    for entry_id, data in client.redis.xrange(k.stream_key(batch_id)):
        ms = int(entry_id.split(b"-")[0])
        entry = decode_entry(data)
        if entry.type == k.ENTRY_EPISODE and entry.index is not None:
            episode_ms.setdefault(entry.index, ms)
        elif entry.type == k.ENTRY_GROUP and entry.group is not None:
            seen = [episode_ms[i] for i in entry.group["indexes"] if i in episode_ms]
            if seen and len(seen) == len(entry.group["indexes"]):
                found.append((ms - max(seen)) / 1000)
    return found


class Bench:
    """One backend's stack, client and policy: runs the batches and keeps their figures."""

    def __init__(
        self,
        backend: str,
        client: RolloutClient,
        fields: dict[str, Any],
        samples: int,
        episode_timeout: int,
        policy: ScriptedPolicy,
        log: IO[str],
        room: int | None = None,
    ) -> None:
        self.backend = backend
        self.client = client
        self.fields = fields  # backend, policy, placement, episode timeout
        self.samples = samples
        self.episode_timeout = episode_timeout
        self.policy = policy  # the server's tail settings: which samples are slow
        self.log = log
        self.room = room  # sandboxes at once (None: every episode of a batch)
        self.figures: dict[str, list[float]] = {}
        self.latencies: list[float] = []
        self.parallelism: dict[str, int] = {}

    def add(self, name: str, value: float | None) -> None:
        if value is not None:
            self.figures.setdefault(name, []).append(value)

    def write(self, row: dict[str, Any]) -> None:
        self.log.write(json.dumps({"backend": self.backend, **row}) + "\n")
        self.log.flush()

    def request(self, tasks: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        count = len(tasks) * self.samples
        parallelism = min(count, self.room or count)
        waves = math.ceil(count / parallelism)  # the deadline only guards against a hang
        return self.fields | {
            "tasks": tasks,
            "samples_per_task": self.samples,
            "parallelism": parallelism,
            "deadline_seconds": waves * self.episode_timeout + 120,
            **extra,
        }

    def timeout(self, request: dict[str, Any]) -> float:
        return float(request["deadline_seconds"]) + 120

    def slow(self, spec: BatchSpec) -> tuple[int, set[str]]:
        """How many samples of the batch are slow, and the groups holding one."""
        slow = [
            e
            for e in map(spec.episode, range(spec.count))
            if self.policy.is_slow(e.group_id, e.sample)
        ]
        return len(slow), {e.group_id for e in slow}

    def check(self, report: dict[str, Any]) -> None:
        if report.get("status") in NEVER_RAN:
            raise SystemExit(
                f"{self.backend}: batch {report.get('batch_id')} ended {report.get('status')}: "
                f"{(report.get('errors') or [])[:3]}"
            )
        if not report.get("ok"):
            print(
                f"    (batch {report.get('batch_id')} {report.get('status')}: "
                f"{(report.get('errors') or [])[:2]})",
                flush=True,
            )

    def settle(self, batch_ids: Iterable[str]) -> None:
        """Wait for the batches' reports and their runs' deletion (so nothing of theirs runs
        into the next timed batch), then take their group entry latencies."""
        ids = sorted(set(batch_ids))
        self.client.wait_many(ids, timeout=1800)
        end = time.monotonic() + SETTLE_SECONDS
        for batch_id in ids:
            while True:
                receipt = self.client.receipt(batch_id)
                if receipt.get("run") is None or receipt.get("cleanup") in (
                    Cleanup.DELETED,
                    Cleanup.KEPT,
                    Cleanup.FAILED,
                ):
                    break
                if time.monotonic() > end:
                    raise RuntimeError(f"the run of batch {batch_id} was not deleted in time")
                time.sleep(0.2)
            self.latencies += group_latencies(self.client, batch_id)

    # -- 1. time to K groups -------------------------------------------------------------------
    def plain(self, tasks: list[dict[str, Any]]) -> dict[str, Any]:
        request = self.request(tasks)
        started = time.perf_counter()
        submission = self.client.submit(**request)
        report = self.client.wait(submission.batch_id, self.timeout(request))
        wall = time.perf_counter() - started
        self.check(report)
        self.settle([submission.batch_id])
        slow, slow_groups = self.slow(submission.spec)
        self.parallelism["plain"] = request["parallelism"]
        return {
            "batch_id": submission.batch_id,
            "submit_to_report": wall,
            "ok": report.get("ok"),
            "slow_samples": slow,
            "slow_groups": len(slow_groups),
        }

    def over_sampled(self, tasks: list[dict[str, Any]], wanted: int) -> dict[str, Any]:
        request = self.request(tasks, groups_wanted=wanted, group_filter=GroupFilter.ANY)
        started = time.perf_counter()
        submission = self.client.submit(**request)
        counted, kth, to_report = 0, None, None
        for _, entry in self.client.entries([submission.batch_id], self.timeout(request)):
            now = time.perf_counter() - started
            if entry.type == k.ENTRY_GROUP and entry.group is not None and entry.group["counted"]:
                counted += 1
                if counted == wanted:
                    kth = now
            elif entry.type == k.ENTRY_REPORT:
                to_report = now
        report = self.client.report(submission.batch_id) or {}
        self.check(report)
        self.settle([submission.batch_id])
        quota = report.get("quota") or {}
        slow, slow_groups = self.slow(submission.spec)
        self.parallelism["over"] = request["parallelism"]
        return {
            "batch_id": submission.batch_id,
            "submit_to_kth_group": kth,
            "submit_to_report": to_report,
            "ok": report.get("ok"),
            "slow_samples": slow,
            "slow_groups": len(slow_groups),
            "counted_with_slow": len(slow_groups & set(quota.get("counted") or [])),
            "counted": len(quota.get("counted") or []),
            "cut": len(quota.get("cut") or []),
            "aborted_episodes": quota.get("aborted_episodes"),
            "saved_sandbox_seconds_at_least": quota.get("saved_sandbox_seconds_at_least"),
            "saved_sandbox_seconds_at_most": quota.get("saved_sandbox_seconds_at_most"),
        }

    def time_to_k(self, tasks: list[dict[str, Any]], number: int) -> None:
        wanted = len(tasks)
        extra = math.ceil(OVER_SAMPLING * wanted) - wanted
        over_tasks = tasks + copies(tasks, extra, number * extra)
        sides: dict[str, Callable[[], dict[str, Any]]] = {
            "plain": lambda: self.plain(tasks),
            "over": lambda: self.over_sampled(over_tasks, wanted),
        }
        order = ["plain", "over"] if number % 2 == 0 else ["over", "plain"]
        got = {name: sides[name]() for name in order}
        plain, over = got["plain"], got["over"]
        kth = over["submit_to_kth_group"]
        ratio = kth / plain["submit_to_report"] if kth is not None else None
        self.add("plain", plain["submit_to_report"])
        self.add("kth", kth)
        self.add("over_report", over["submit_to_report"])
        self.add("ratio", ratio)
        for name in order:
            self.write({"round": number + 1, "measure": name, **got[name]})
        shown = f"{kth:.2f} s" if kth is not None else "never (quota not met)"
        print(
            f"  round {number + 1} {self.backend}: plain {plain['submit_to_report']:.2f} s "
            f"(slow samples {plain['slow_samples']} in {plain['slow_groups']} groups) | "
            f"over-sampled K-th group {shown}, report {over['submit_to_report']:.2f} s "
            f"(slow {over['slow_samples']} in {over['slow_groups']} groups, "
            f"{over['counted_with_slow']} of them counted; cut {over['cut']} groups, "
            f"{over['aborted_episodes']} episodes aborted) | ratio "
            + (f"{ratio:.2f}" if ratio is not None else "-"),
            flush=True,
        )

    # -- 2. continuous vs synchronous ----------------------------------------------------------
    def synchronous(self, tasks: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
        started = time.perf_counter()
        ids, slow = [], 0
        for _ in range(rounds):
            request = self.request(tasks)
            submission = self.client.submit(**request)
            self.check(self.client.wait(submission.batch_id, self.timeout(request)))
            ids.append(submission.batch_id)
            slow += self.slow(submission.spec)[0]
        wall = time.perf_counter() - started
        self.settle(ids)
        groups = rounds * len(tasks)
        return {
            "seconds": wall,
            "groups": groups,
            "groups_per_second": groups / wall,
            "batches": ids,
            "slow_samples": slow,
        }

    def continuous(self, tasks: list[dict[str, Any]], in_flight: int, total: int) -> dict[str, Any]:
        # The sampler behind `RolloutClient.sample`, built here to know its batches (to wait
        # for the cancelled rest and to read their streams).
        request = self.request(tasks)
        base = {n: v for n, v in request.items() if n not in ("tasks", "samples_per_task")}
        base.pop("parallelism")  # every batch is its own size: all of it at once
        sampler = ContinuousSampler(
            self.client,
            tasks,
            self.samples,
            groups_in_flight=in_flight,
            total_groups=total,
            group_filter=GroupFilter.ANY,
            request=base,
        )
        started = time.perf_counter()
        given = sum(1 for _ in sampler.groups(timeout=self.timeout(request) * 2))
        wall = time.perf_counter() - started
        ids = sorted(set(sampler.following.names.values()))
        self.settle(ids)
        slow = 0
        for batch_id in ids:
            receipt = self.client.receipt(batch_id)
            if receipt.get("spec"):
                slow += self.slow(BatchSpec.from_dict(receipt["spec"]))[0]
        return {
            "seconds": wall,
            "groups": given,
            "groups_per_second": given / wall,
            "batches": ids,
            "slow_samples": slow,
        }

    def sampling(self, tasks: list[dict[str, Any]], number: int) -> None:
        in_flight, total = len(tasks), 2 * len(tasks)
        sides: dict[str, Callable[[], dict[str, Any]]] = {
            "synchronous": lambda: self.synchronous(tasks, total // in_flight),
            "continuous": lambda: self.continuous(tasks, in_flight, total),
        }
        order = ["synchronous", "continuous"] if number % 2 == 0 else ["continuous", "synchronous"]
        got = {name: sides[name]() for name in order}
        sync, cont = got["synchronous"], got["continuous"]
        ratio = cont["groups_per_second"] / sync["groups_per_second"]
        self.add("sync_gps", sync["groups_per_second"])
        self.add("cont_gps", cont["groups_per_second"])
        self.add("cont_ratio", ratio)
        for name in order:
            self.write({"round": number + 1, "measure": name, **got[name]})
        print(
            f"  round {number + 1} {self.backend}: synchronous {sync['groups']} groups in "
            f"{sync['seconds']:.2f} s (slow samples {sync['slow_samples']}) | continuous "
            f"{cont['groups']} groups in {cont['seconds']:.2f} s ({len(cont['batches'])} batches, "
            f"slow samples {cont['slow_samples']}) | ratio {ratio:.2f}",
            flush=True,
        )


def warm_up(bench: Bench, tasks: list[dict[str, Any]]) -> None:
    """One small unmeasured batch: worker imports, first sandboxes (on the node: images)."""
    request = bench.request(tasks[:2])
    submission = bench.client.submit(**request)
    bench.check(bench.client.wait(submission.batch_id, bench.timeout(request)))
    bench.settle([submission.batch_id])
    bench.latencies.clear()


def run_backend(
    backend: str,
    args: argparse.Namespace,
    tasks: list[dict[str, Any]],
    script: dict[str, Any],
    episode_timeout: int,
    log: IO[str],
    real: tuple[kc.Cluster, kc.RealNode] | None,
) -> Bench:
    tail = {
        "turn_seconds": args.turn_seconds,
        "slow_fraction": SLOW_FRACTION,
        "slow_factor": SLOW_FACTOR,
    }
    slow_turn = args.turn_seconds * SLOW_FACTOR + 1  # + the script's longest own delay
    policy_timeout = min(600.0, max(60.0, 3 * slow_turn))
    if real is None:
        host = url_host = "127.0.0.1"
        env = {"ROLLOUT_LOCAL_ISOLATION": "bwrap"}  # bubblewrap or fail: never unsandboxed
        placement: dict[str, Any] = {"backend": "local"}
    else:
        cluster, node = real
        # Pods reach the policy on the node's own address (the server listens everywhere).
        host, url_host = "0.0.0.0", node_address(cluster, node)
        env = {"KUBECONFIG": str(cluster.kubeconfig)}
        placement = node.batch_fields() | {"backend": "kubernetes", "capacity_check": "warn"}
        # The sandboxes mostly wait on the policy: a small CPU request lets every episode of
        # the over-sampled batch run at once (2 cores / 25m = 80 Pods), as on the local
        # backend, so the comparison is of the tail, not of waves (issue 26's concern).
        placement["resources"] = {"cpu_request": "25m", "memory_request": "32Mi"}
    with (
        running(host=host, script=script, **tail) as server,
        LocalStack(collectors=2, extra_env=env) as stack,
    ):
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        fields = placement | {
            "episode_timeout_seconds": episode_timeout,
            "policy": {
                "url": f"http://{url_host}:{server.port}",
                "request_timeout_seconds": policy_timeout,
            },
        }
        room = None
        if real is not None:
            probe = fields | {"tasks": tasks, "samples_per_task": args.samples}
            room, text = node_room(*real, parse_spec(probe, max_episodes=None))
            if room < 1:
                raise SystemExit(f"the real node has no room for a sandbox: {text}")
            print(f"real node {real[1].name}: {text}", flush=True)
        bench = Bench(
            backend,
            client,
            fields,
            args.samples,
            episode_timeout,
            ScriptedPolicy(script, **tail),
            log,
            room,
        )
        warm_up(bench, tasks)
        print(f"{LABELS[backend]}: {len(tasks)} tasks x {args.samples} samples", flush=True)
        for number in range(args.rounds):
            bench.time_to_k(tasks, number)
            if real is None:
                bench.sampling(tasks, number)
        client.close()
    return bench


def node_address(cluster: kc.Cluster, node: kc.RealNode) -> str:
    found = cluster.api_client.sanitize_for_serialization(cluster.core.read_node(node.name))
    addresses = (found.get("status") or {}).get("addresses") or []
    return str(next(a["address"] for a in addresses if a.get("type") == "InternalIP"))


def node_room(cluster: kc.Cluster, node: kc.RealNode, spec: BatchSpec) -> tuple[int, str]:
    """How many sandboxes of this shape fit now, by the workers' own preflight arithmetic."""
    api = cluster.api_client
    nodes = api.sanitize_for_serialization(cluster.core.list_node())["items"]
    pods = api.sanitize_for_serialization(
        cluster.core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed"
        )
    )["items"]
    runtime = api.sanitize_for_serialization(
        kube_client.NodeV1Api(api).read_runtime_class(node.runtime_class)
    )
    overhead = (runtime.get("overhead") or {}).get("podFixed") or {}
    fits, text = capacity_plan(spec, nodes, pods, overhead, runtime.get("scheduling") or {})
    return fits, text


def ensure_real_node() -> tuple[kc.Cluster, kc.RealNode]:
    try:
        cluster = kc.ensure_cluster()
        return cluster, kc.ensure_real_node(cluster)
    except (kc.ClusterUnavailable, kc.RealNodeUnavailable, OSError) as exc:
        raise SystemExit(
            f"the real node was asked for (--backends) and cannot be had: {exc}"
        ) from exc


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4, help="samples per task (S)")
    parser.add_argument("--turn-seconds", type=float, default=0.5)
    parser.add_argument("--backends", choices=sorted(BACKENDS), default="local")
    parser.add_argument("--out", default=None, help="JSON lines of every run (default: tmp)")
    args = parser.parse_args()
    if args.rounds < 1 or args.samples < 1 or args.turn_seconds < 0:
        parser.error("--rounds and --samples must be at least 1, --turn-seconds at least 0")
    backends = BACKENDS[args.backends]
    loads = [os.getloadavg()]
    print(f"load average at start: {loads[0]}", flush=True)
    # The real node first: a missing one fails the run before anything is measured.
    real = ensure_real_node() if "kubernetes" in backends else None
    tasks, script, episode_timeout = prepare(args.turn_seconds)
    out = Path(args.out or tempfile.mkstemp(prefix="bench-tail-", suffix=".jsonl")[1])
    print(f"runs logged to {out}", flush=True)
    benches: dict[str, Bench] = {}
    with out.open("a") as log:
        for backend in backends:
            benches[backend] = run_backend(
                backend,
                args,
                tasks,
                script,
                episode_timeout,
                log,
                real if backend == "kubernetes" else None,
            )
        loads.append(os.getloadavg())
        summary = print_table(benches, args, loads, SLOW_FRACTION, SLOW_FACTOR)
        log.write(json.dumps({"summary": summary, "args": vars(args), "loadavg": loads}) + "\n")


if __name__ == "__main__":
    main()

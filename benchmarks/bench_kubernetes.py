"""The kubernetes backend on KWOK nodes: report and row latency, API reads, CPU and memory per
episode, beside a no-op chord floor measured in the same run and the guide's own figures.

Each figure is the median of --runs runs [min-max] unless the table says otherwise.

- Terminal: when the benchmark's own watch of the batch namespace first saw the episode's Pod
  Succeeded or Failed (better than finishedAt, which has 1 s resolution).
- Report latency: last Pod terminal -> the trainer's stream delivers the `report` entry
  (client receive time; `reported_at` of the report is printed beside it).
- Row latency: each episode's Pod terminal -> its row delivered by the trainer's stream.
- API reads: the API server's own `apiserver_request_total`, scraped before the batch and after
  its records and cleanup: GET, LIST, WATCH of pods, jobs and namespaces plus pod log reads
  (CONNECT pods/log), less the reads of the KWOK harness and of the benchmark's watch (counted
  on their side). The metric has no client or namespace label, so other clients of a shared
  cluster (other sessions) inflate it; the second figure keeps only the kinds the workers
  make (it leaves out single-Pod GETs, pods/status and cluster-wide watches, never ours).
- CPU: every process of ours that works for the batch (the control worker and its prefork
  children, the collectors; proc.py), and Redis beside it, from submit to records and cleanup
  done. The floor is a no-op Celery chord of as many tasks on workers of the same shape.
- Memory: peak summed RSS of the workers while the batch runs, and Redis used_memory's peak.
- Episodes are served by the KWOK harness as all-success draws of its seeded mix; the
  harness annotates a Pod `--seconds` after taking it (0: at once), and the KWOK stage ends it
  1-2.5 s later. The flatness rows run --length-episodes episodes of 5 s and 300 s, each
  also shown less the workers' idle floor (their CPU per second with no batch, timed for
  --idle-seconds after the warm-up) times the run's metered window.

Needs the local cluster (hack/localkube/cluster.sh up; eval "$(hack/localkube/cluster.sh env)").

    python -m benchmarks.bench_kubernetes [--sizes 10 1000] [--parallelism 200] [--runs 3]
        [--lengths 5 300] [--length-episodes 200] [--long-runs 1] [--deadline 600]
        [--pod-create-rate R]

Before the runs it prints, per size, the least time the batch needs by arithmetic
(rollout_worker/schedule.py: Pod creation at ROLLOUT_POD_CREATE_RATE, waves x the episode
floor); a batch whose deadline is shorter is refused by the workers, with that arithmetic.
`--pod-create-rate` sets ROLLOUT_POD_CREATE_RATE for the workers (default: theirs, 20/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from kubernetes.client.rest import ApiException

from benchmarks.harness import append_json, new_parser, percentile, redis_pid, worker_roles
from benchmarks.kubernetes_table import print_table
from benchmarks.kwok_bench import (
    ClusterMeter,
    MemorySampler,
    TerminalWatch,
    TimedEpisodes,
    api_reads,
)
from benchmarks.proc import Meter
from rollout_wire import constants as k
from rollout_wire.request import new_batch_id
from rollout_worker.cli.stack import LocalStack
from rollout_worker.schedule import deadline_problem, episode_floor, minimum_time
from rollout_worker.settings import Settings
from tests.integration.kwok_episodes import (
    RUNTIME_CLASS as RUNTIME,
)
from tests.integration.kwok_episodes import (
    StagesMismatch,
    ensure_kwok_runtime,
    verify_stages,
)
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient


class BatchMeters:
    """What watches one batch: started before its submission, stopped after its records."""

    def __init__(self, ctx: dict[str, Any], namespace: str, size: int) -> None:
        episodes: TimedEpisodes = ctx["episodes"]
        self.before = api_reads()
        self.harness0 = (episodes.pod_gets, episodes.pod_watches)
        self.terminal = TerminalWatch(ctx["cluster"], namespace, size)
        self.terminal.start()
        self.memory = MemorySampler(ctx["roots"], ctx["redis"])
        self.memory.start()
        stack: LocalStack = ctx["stack"]
        self.meter = Meter(ctx["roles"], ctx["redis_pid"], str(stack.dir), reap_orphans=False)
        self.meter.start()
        self.cluster_meter = ClusterMeter().start()
        self.harness_cpu = sum(os.times()[:2])
        self.start = time.time()
        self.metered_from = time.monotonic()

    def stop(self) -> None:
        self.usage, _ = self.meter.stop()
        self.cluster_used = self.cluster_meter.stop()
        # This process: the KWOK harness's threads (claims, annotations) and the benchmark's watch.
        self.cluster_used["harness"] = round(sum(os.times()[:2]) - self.harness_cpu, 3)
        self.window = time.monotonic() - self.metered_from
        self.memory.stop()
        self.terminal.stop()
        after = api_reads()
        before = self.before
        self.delta = {
            key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key)
        }

    def leave_out_own_reads(self, episodes: TimedEpisodes) -> None:
        """The harness's and the benchmark watch's own reads are not ours."""
        delta = self.delta
        gets, watches = (
            episodes.pod_gets - self.harness0[0],
            episodes.pod_watches - self.harness0[1],
        )
        delta["GET pods resource"] = delta.get("GET pods resource", 0) - gets
        delta["WATCH pods cluster"] = delta.get("WATCH pods cluster", 0) - watches
        delta["WATCH pods namespace"] = (
            delta.get("WATCH pods namespace", 0) - self.terminal.requests
        )


def follow_entries(
    rollout: RolloutClient, batch_id: str, deadline: int
) -> tuple[dict[int, float], float]:
    """When each episode's row and the report arrived (client receive time)."""
    rows: dict[int, float] = {}
    report_at = 0.0
    for _, entry in rollout.entries([batch_id], timeout=deadline + 600):
        now = time.time()
        if entry.type == k.ENTRY_EPISODE and entry.index is not None:
            rows.setdefault(entry.index, now)
        elif entry.type == k.ENTRY_REPORT:
            report_at = now
    return rows, report_at


def wait_records(rollout: RolloutClient, batch_id: str, report_at: float) -> str:
    """Records (job.json, events) and cleanup follow the report; wait for them (bounded) so
    their CPU and API reads are this batch's."""
    settled = "?"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        receipt = rollout.receipt(batch_id) or {}
        records, cleanup = receipt.get("records"), receipt.get("cleanup")
        settled = f"records {records} +{time.time() - report_at:.0f}s, cleanup {cleanup}"
        if records in ("complete", "failed") and (
            cleanup in ("deleted", "failed", "kept") or time.monotonic() > end - 30
        ):
            break
        time.sleep(0.5)
    return settled


def one_batch(
    ctx: dict[str, Any], size: int, parallelism: int, seconds: float, deadline: int
) -> dict[str, Any]:
    rollout: RolloutClient = ctx["rollout"]
    episodes: TimedEpisodes = ctx["episodes"]
    batch_id = new_batch_id()
    namespace = f"rollout-{batch_id}"
    episodes.serve(batch_id, seconds)
    meters = BatchMeters(ctx, namespace, size)
    rollout.submit(
        batch_id=batch_id,
        count=size,
        parallelism=min(size, parallelism),
        backend="kubernetes",
        runtime=RUNTIME,
        node_selector=ctx["placement"]["nodeSelector"],
        tolerations=ctx["placement"]["tolerations"],
        deadline_seconds=deadline,
    )
    rows, report_at = follow_entries(rollout, batch_id, deadline)
    report = rollout.report(batch_id) or {}
    settled = wait_records(rollout, batch_id, report_at)
    meters.stop()
    # The next run starts on a clean cluster: a namespace of thousands of Pods being deleted
    # would load this machine during it (not measured: after the meters stop).
    gone_after = wait_namespace_gone(ctx["cluster"], namespace, report_at)
    meters.leave_out_own_reads(episodes)
    result = batch_result(ctx, meters, batch_id, size, seconds, report, rows, report_at)
    result["settled"] = settled
    result["namespace_gone_after_report"] = gone_after
    append_json(ctx["log"], result)
    gone = "not yet" if gone_after is None else f"+{gone_after:.0f}s after the report"
    print(
        f"  # {size} x {seconds:g}s: ok={result['ok']} {result['reward_sum']}/{size} "
        f"wall {result['wall']:.1f}s report {result['report_latency']:.3f}s rows "
        f"p50 {result['row_median']:.3f}s reads/ep {result['reads'] / size:.2f} "
        f"cpu {meters.usage.ours / size * 1000:.1f} ms/ep collect copies "
        f"{result['collect_copies']} ({settled}; namespace gone {gone}) reads "
        f"{result['reads_by_kind']}",
        flush=True,
    )
    print(
        f"    last Pod seen +{result['last_pod_seen'] or 0:.1f}s; {meters.cluster_used}",
        flush=True,
    )
    return result


def batch_result(
    ctx: dict[str, Any],
    meters: BatchMeters,
    batch_id: str,
    size: int,
    seconds: float,
    report: dict[str, Any],
    rows: dict[int, float],
    report_at: float,
) -> dict[str, Any]:
    """One run's record (a JSON line of --out); its keys are the table's inputs."""
    terminal, usage, memory, delta = meters.terminal, meters.usage, meters.memory, meters.delta
    last_terminal = max(terminal.terminal.values()) if terminal.terminal else float("nan")
    row_lat = [rows[i] - terminal.terminal[i] for i in rows if i in terminal.terminal]
    annotated = ctx["episodes"].annotated.get(f"rollout-{batch_id}", {})
    return {
        "batch_id": batch_id,
        "size": size,
        "seconds": seconds,
        "ok": report.get("ok"),
        "reward_sum": report.get("reward_sum"),
        "status": report.get("status"),
        "errors": (report.get("errors") or [])[:3],
        "wall": report_at - meters.start,
        "report_latency": report_at - last_terminal,
        "reported_at_latency": float(report.get("reported_at") or 0) - last_terminal,
        "annotated_to_report": report_at - max(annotated.values()) if annotated else None,
        "terminal_seen": len(terminal.terminal),
        "rows_seen": len(rows),
        "row_median": statistics.median(row_lat) if row_lat else float("nan"),
        "row_p95": percentile(row_lat, 0.95) if row_lat else float("nan"),
        "reads": sum(delta.values()),
        "reads_by_kind": {key: v for key, v in sorted(delta.items()) if v},
        # Copies of collect tasks that found their episode being collected (redeliveries).
        "collect_copies": int(ctx["rollout"].redis.get(k.collect_copies_key(batch_id)) or 0),
        "cpu_ours": usage.ours,
        "cpu_control": usage.control,
        "cpu_collectors": usage.collectors,
        "cpu_redis": usage.redis,
        "cpu_window": meters.window,
        # What the workers spend doing nothing (idle_floor), over this window: the rest is
        # what the batch cost.
        "cpu_net": usage.ours - ctx["idle_rate"] * meters.window,
        "rss_peak": memory.rss_peak,
        "rss_start": memory.rss_start,
        "redis_peak": memory.redis_peak,
        "redis_start": memory.redis_start,
        "settled": None,  # set by one_batch, here to keep the record's key order
        "harness_errors": ctx["episodes"].errors[-3:],
        "namespace_gone_after_report": None,  # likewise
        # Where the wall went outside the workers (ClusterMeter), and when the last Pod of
        # the batch first appeared (the Job controller's creation pace).
        "cluster": meters.cluster_used,
        "last_pod_seen": max(terminal.seen.values()) - meters.start if terminal.seen else None,
    }


def wait_namespace_gone(
    cluster: kc.Cluster, namespace: str, since: float, timeout: float = 600
) -> float | None:
    """Seconds from `since` until the namespace is gone (None: still there after timeout)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            cluster.core.read_namespace(namespace)
        except ApiException as exc:
            if exc.status == 404:
                return time.time() - since
        time.sleep(1)
    return None


def idle_floor(ctx: dict[str, Any], seconds: float) -> float:
    """CPU seconds per second the workers use with no batch at all (their consumer loops, the
    broker polls, the unacked sweep): paid over a long batch's whole wall, whatever it runs."""
    meter = Meter(ctx["roles"], ctx["redis_pid"], str(ctx["stack"].dir), reap_orphans=False)
    meter.start()
    time.sleep(seconds)
    usage, _ = meter.stop()
    return usage.ours / seconds


def noop_floor(ctx: dict[str, Any], n: int, runs: int) -> list[Any]:
    from benchmarks.bench_pipeline import NoopWorkers, noop_chord

    os.environ["ROLLOUT_REDIS_URL"] = ctx["stack"].redis_url  # read by noop_app at import
    usages = []
    with NoopWorkers(ctx["stack"]) as workers:
        noop_chord(ctx["stack"], workers, 20)  # warm-up, not counted
        for _ in range(runs):
            _, usage = noop_chord(ctx["stack"], workers, n)
            usages.append(usage)
    return usages


def print_schedule(args: argparse.Namespace, rate: float) -> None:
    """The least time each size needs by arithmetic, and whether its deadline admits it."""
    floor = episode_floor("kubernetes", args.seconds or None)
    for size in args.sizes:
        par = min(size, args.parallelism)
        plan = minimum_time(size, par, episode_seconds=floor, create_rate=rate or None)
        refused = deadline_problem(
            size,
            par,
            args.deadline,
            backend="kubernetes",
            create_rate=rate,
            expected_episode_seconds=args.seconds or None,
        )
        print(
            f"N={size}, parallelism {par}: needs at least {plan.minimum_seconds:.0f} s "
            f"(creation at {rate:g} Pods/s {plan.creation_seconds:.0f} s, {plan.waves} waves x "
            f"{floor:g} s); deadline {args.deadline} s: "
            + ("admitted" if refused is None else f"REFUSED: {refused}"),
            flush=True,
        )


def parse_args() -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--parallelism", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.0, help="episode length (harness)")
    parser.add_argument("--lengths", type=float, nargs="*", default=[5, 300])
    parser.add_argument("--length-episodes", type=int, default=200)
    parser.add_argument("--long-runs", type=int, default=1, help="runs of episodes >= 30 s")
    parser.add_argument("--deadline", type=int, default=600)
    parser.add_argument(
        "--idle-seconds", type=float, default=60.0, help="the workers' idle floor is timed so long"
    )
    parser.add_argument("--collect-concurrency", type=int, default=64)
    parser.add_argument(
        "--pod-create-rate",
        type=float,
        default=None,
        help="ROLLOUT_POD_CREATE_RATE for the workers (default: theirs)",
    )
    parser.add_argument("--out", default=None, help="JSON lines of every run (default: tmp)")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the stack's folder (worker logs)"
    )
    args = parser.parse_args()
    assert args.runs >= 3, "a figure is a median of at least 3 runs"
    return args


def prepare_cluster(args: argparse.Namespace) -> tuple[kc.Cluster, dict[str, str], float]:
    """The KWOK cluster checked, the workers' env, and the Pod creation rate they will use."""
    cluster = kc.ensure_cluster()
    kc.ensure_kwok_nodes(cluster, 4)
    try:  # a shared, busy cluster can be slow to start the probe: warn, the runs will tell
        verify_stages(cluster, timeout=120)
    except StagesMismatch as exc:
        print(f"warning: {exc}", flush=True)
    ensure_kwok_runtime(cluster)  # the tests' RuntimeClass (same name, same overhead)
    env = {
        "KUBECONFIG": str(cluster.kubeconfig),
        "ROLLOUT_MAX_BATCH_EPISODES": str(max(5000, *args.sizes)),
    }
    rate = Settings().pod_create_rate if args.pod_create_rate is None else args.pod_create_rate
    if args.pod_create_rate is not None:
        env["ROLLOUT_POD_CREATE_RATE"] = str(args.pod_create_rate)
    return cluster, env, rate


def run_plan(
    ctx: dict[str, Any], args: argparse.Namespace
) -> dict[tuple[int, float], list[dict[str, Any]]]:
    """The warm-up, the idle floor, then every size and every episode length, run by run."""
    results: dict[tuple[int, float], list[dict[str, Any]]] = {}
    ctx["idle_rate"] = 0.0
    one_batch(ctx, 10, 10, 0, args.deadline)  # warm-up (imports, connections), not counted
    if args.lengths:
        ctx["idle_rate"] = idle_floor(ctx, args.idle_seconds)
        print(f"workers idle: {ctx['idle_rate'] * 1000:.2f} ms CPU per s", flush=True)
    plan = [(size, args.seconds, args.runs) for size in args.sizes]
    plan += [
        (args.length_episodes, s, args.long_runs if s >= 30 else args.runs) for s in args.lengths
    ]
    for size, seconds, runs in plan:
        for _ in range(runs):
            results.setdefault((size, seconds), []).append(
                one_batch(ctx, size, args.parallelism, seconds, args.deadline)
            )
    return results


def main() -> None:
    args = parse_args()
    cluster, env, rate = prepare_cluster(args)
    print_schedule(args, rate)
    out = Path(args.out or tempfile.mkstemp(prefix="bench-kubernetes-", suffix=".jsonl")[1])
    with (
        tempfile.TemporaryDirectory() as logs,
        TimedEpisodes(cluster, Path(logs)) as episodes,
        LocalStack(
            collect_concurrency=args.collect_concurrency, extra_env=env, keep_dir=args.keep_logs
        ) as stack,
        out.open("a") as log,
    ):
        stack.wait_ready()
        roles = worker_roles(stack)
        ctx = {
            "stack": stack,
            "cluster": cluster,
            "episodes": episodes,
            "rollout": RolloutClient(stack.redis_url),
            "roles": roles,
            "roots": roles["control"] + roles["collectors"],
            "redis_pid": redis_pid(stack),
            "redis": redis.Redis.from_url(stack.redis_url),
            "placement": kc.kwok_placement(),
            "log": log,
        }
        print(f"runs logged to {out}; worker logs in {stack.dir}", flush=True)
        results = run_plan(ctx, args)
        floor_n = max(args.sizes)
        floor = noop_floor(ctx, floor_n, args.runs)
        used_memory_peak = int(ctx["redis"].info("memory")["used_memory_peak"])
        ctx["rollout"].close()
        print_table(args, results, floor, floor_n, used_memory_peak)
    sys.stdout.flush()
    # Celery's result consumer of the no-op chord retries its (stopped) Redis for minutes at
    # interpreter exit: nothing is left to clean up here.
    os._exit(0)


if __name__ == "__main__":
    main()

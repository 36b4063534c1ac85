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
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from kubernetes.client.rest import ApiException

from benchmarks.kwok_bench import (
    ClusterMeter,
    MemorySampler,
    TerminalWatch,
    TimedEpisodes,
    api_reads,
    percentile,
)
from benchmarks.proc import Meter, Stats
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

MB = 1024 * 1024
# The guide's script, seed, 10 episodes in parallel on real nodes.
GUIDE = {"all ready s": 3.7, "all rewards s": 8.4, "client sees Job complete s": 12.7}


def one_batch(
    ctx: dict[str, Any], size: int, parallelism: int, seconds: float, deadline: int
) -> dict[str, Any]:
    stack: LocalStack = ctx["stack"]
    rollout: RolloutClient = ctx["rollout"]
    episodes: TimedEpisodes = ctx["episodes"]
    batch_id = new_batch_id()
    namespace = f"rollout-{batch_id}"
    episodes.serve(batch_id, seconds)
    before = api_reads()
    harness0 = (episodes.pod_gets, episodes.pod_watches)
    terminal = TerminalWatch(ctx["cluster"], namespace, size)
    terminal.start()
    memory = MemorySampler(ctx["roots"], ctx["redis"])
    memory.start()
    meter = Meter(ctx["roles"], ctx["redis_pid"], str(stack.dir), reap_orphans=False).start()
    cluster_meter = ClusterMeter().start()
    harness_cpu = sum(os.times()[:2])
    start = time.time()
    metered_from = time.monotonic()
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
    rows: dict[int, float] = {}
    report_at = 0.0
    for _, entry in rollout.entries([batch_id], timeout=deadline + 600):
        now = time.time()
        if entry.type == k.ENTRY_EPISODE and entry.index is not None:
            rows.setdefault(entry.index, now)
        elif entry.type == k.ENTRY_REPORT:
            report_at = now
    report = rollout.report(batch_id) or {}
    # Records (job.json, events) and cleanup follow the report; wait for them (bounded) so
    # their CPU and API reads are this batch's.
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
    usage, _ = meter.stop()
    cluster_used = cluster_meter.stop()
    # This process: the KWOK harness's threads (claims, annotations) and the benchmark's watch.
    cluster_used["harness"] = round(sum(os.times()[:2]) - harness_cpu, 3)
    window = time.monotonic() - metered_from
    memory.stop()
    terminal.stop()
    after = api_reads()
    delta = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key)}
    # The next run starts on a clean cluster: a namespace of thousands of Pods being deleted
    # would load this machine during it (not measured: after the meters stop).
    gone_after = wait_namespace_gone(ctx["cluster"], namespace, report_at)
    # The harness's and the benchmark watch's own reads are not ours.
    gets, watches = episodes.pod_gets - harness0[0], episodes.pod_watches - harness0[1]
    delta["GET pods resource"] = delta.get("GET pods resource", 0) - gets
    delta["WATCH pods cluster"] = delta.get("WATCH pods cluster", 0) - watches
    delta["WATCH pods namespace"] = delta.get("WATCH pods namespace", 0) - terminal.requests
    reads = sum(delta.values())
    last_terminal = max(terminal.terminal.values()) if terminal.terminal else float("nan")
    row_lat = [rows[i] - terminal.terminal[i] for i in rows if i in terminal.terminal]
    annotated = episodes.annotated.get(namespace, {})
    result = {
        "batch_id": batch_id,
        "size": size,
        "seconds": seconds,
        "ok": report.get("ok"),
        "reward_sum": report.get("reward_sum"),
        "status": report.get("status"),
        "errors": (report.get("errors") or [])[:3],
        "wall": report_at - start,
        "report_latency": report_at - last_terminal,
        "reported_at_latency": float(report.get("reported_at") or 0) - last_terminal,
        "annotated_to_report": report_at - max(annotated.values()) if annotated else None,
        "terminal_seen": len(terminal.terminal),
        "rows_seen": len(rows),
        "row_median": statistics.median(row_lat) if row_lat else float("nan"),
        "row_p95": percentile(row_lat, 0.95) if row_lat else float("nan"),
        "reads": reads,
        "reads_by_kind": {key: v for key, v in sorted(delta.items()) if v},
        # Copies of collect tasks that found their episode being collected (redeliveries).
        "collect_copies": int(rollout.redis.get(k.collect_copies_key(batch_id)) or 0),
        "cpu_ours": usage.ours,
        "cpu_control": usage.control,
        "cpu_collectors": usage.collectors,
        "cpu_redis": usage.redis,
        "cpu_window": window,
        # What the workers spend doing nothing (idle_floor), over this window: the rest is
        # what the batch cost.
        "cpu_net": usage.ours - ctx["idle_rate"] * window,
        "rss_peak": memory.rss_peak,
        "rss_start": memory.rss_start,
        "redis_peak": memory.redis_peak,
        "redis_start": memory.redis_start,
        "settled": settled,
        "harness_errors": episodes.errors[-3:],
        "namespace_gone_after_report": gone_after,
        # Where the wall went outside the workers (ClusterMeter), and when the last Pod of
        # the batch first appeared (the Job controller's creation pace).
        "cluster": cluster_used,
        "last_pod_seen": max(terminal.seen.values()) - start if terminal.seen else None,
    }
    ctx["log"].write(json.dumps(result) + "\n")
    ctx["log"].flush()
    gone = "not yet" if gone_after is None else f"+{gone_after:.0f}s after the report"
    print(
        f"  # {size} x {seconds:g}s: ok={result['ok']} {result['reward_sum']}/{size} "
        f"wall {result['wall']:.1f}s report {result['report_latency']:.3f}s rows "
        f"p50 {result['row_median']:.3f}s reads/ep {reads / size:.2f} "
        f"cpu {usage.ours / size * 1000:.1f} ms/ep collect copies {result['collect_copies']} "
        f"({settled}; namespace gone {gone}) reads {result['reads_by_kind']}",
        flush=True,
    )
    print(f"    last Pod seen +{result['last_pod_seen'] or 0:.1f}s; {cluster_used}", flush=True)
    return result


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


# Reads the workers never make (no GET of single Pods or of pods/status, no cluster-wide watch):
# on a shared cluster they are other sessions' (their KWOK harnesses and probes).
NOT_WORKERS = ("GET pods resource", "GET pods/status resource", "WATCH pods cluster")


def worker_kind_reads(result: dict[str, Any]) -> int:
    return sum(
        count
        for kind, count in result["reads_by_kind"].items()
        if kind not in NOT_WORKERS and (not kind.startswith("WATCH") or kind.endswith("namespace"))
    )


def cell(values: list[float], digits: int = 2, scale: float = 1.0) -> str:
    values = [v for v in values if v == v]  # drop NaN
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * scale:.{digits}f} (1 run)"
    return Stats(values).fmt(scale=scale, digits=digits)


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    print_schedule(args, rate)
    out = Path(args.out or tempfile.mkstemp(prefix="bench-kubernetes-", suffix=".jsonl")[1])
    results: dict[tuple[int, float], list[dict[str, Any]]] = {}
    with (
        tempfile.TemporaryDirectory() as logs,
        TimedEpisodes(cluster, Path(logs)) as episodes,
        LocalStack(
            collect_concurrency=args.collect_concurrency, extra_env=env, keep_dir=args.keep_logs
        ) as stack,
        out.open("a") as log,
    ):
        stack.wait_ready()
        roles = {
            "control": [w.proc.pid for w in stack.workers if w.queue == "control"],
            "collectors": [w.proc.pid for w in stack.workers if w.queue == "collect"],
        }
        ctx = {
            "stack": stack,
            "cluster": cluster,
            "episodes": episodes,
            "rollout": RolloutClient(stack.redis_url),
            "roles": roles,
            "roots": roles["control"] + roles["collectors"],
            "redis_pid": stack.redis_proc.pid if stack.redis_proc else None,
            "redis": redis.Redis.from_url(stack.redis_url),
            "placement": kc.kwok_placement(),
            "log": log,
        }
        print(f"runs logged to {out}; worker logs in {stack.dir}", flush=True)
        ctx["idle_rate"] = 0.0
        one_batch(ctx, 10, 10, 0, args.deadline)  # warm-up (imports, connections), not counted
        if args.lengths:
            ctx["idle_rate"] = idle_floor(ctx, args.idle_seconds)
            print(f"workers idle: {ctx['idle_rate'] * 1000:.2f} ms CPU per s", flush=True)
        plan = [(size, args.seconds, args.runs) for size in args.sizes]
        plan += [
            (args.length_episodes, s, args.long_runs if s >= 30 else args.runs)
            for s in args.lengths
        ]
        for size, seconds, runs in plan:
            for _ in range(runs):
                results.setdefault((size, seconds), []).append(
                    one_batch(ctx, size, args.parallelism, seconds, args.deadline)
                )
        floor_n = max(args.sizes)
        floor = noop_floor(ctx, floor_n, args.runs)
        used_memory_peak = int(ctx["redis"].info("memory")["used_memory_peak"])
        ctx["rollout"].close()
        print_table(args, results, floor, floor_n, used_memory_peak)
    sys.stdout.flush()
    # Celery's result consumer of the no-op chord retries its (stopped) Redis for minutes at
    # interpreter exit: nothing is left to clean up here.
    os._exit(0)


def print_table(
    args: argparse.Namespace,
    results: dict[tuple[int, float], list[dict[str, Any]]],
    floor: list[Any],
    floor_n: int,
    used_memory_peak: int,
) -> None:
    floor_ms = [u.ours / floor_n * 1000 for u in floor]
    floor_redis = [u.redis / floor_n * 1000 for u in floor]
    print()
    print(
        f"KWOK, {os.cpu_count()} cpus; workers: control prefork x2, 2 collectors threads "
        f"x{args.collect_concurrency}; parallelism min(N, {args.parallelism}); deadline "
        f"{args.deadline}s; median [min-max] of the runs"
    )
    cols = [key for key in results if key[1] == args.seconds and key[0] in args.sizes]
    heads = [f"N={n}, {s:g}s eps ({len(results[(n, s)])} runs)" for n, s in cols]
    width = 30

    def row(label: str, fn, digits: int = 2, goal: str = "", scale: float = 1.0) -> None:
        cells = [cell([fn(r) for r in results[key]], digits, scale) for key in cols]
        print(f"{label:<44}" + "".join(f"{c:>{width}}" for c in cells) + f"   {goal}")

    print(f"{'figure':<44}" + "".join(f"{h:>{width}}" for h in heads) + "   goal / reference")
    row("ok (reward_sum = N)", lambda r: float(r["ok"] and r["reward_sum"] == r["size"]), 0)
    row("wall: submit -> report received s", lambda r: r["wall"])
    for key in cols:
        walls = [r["wall"] for r in results[key]]
        spread = (max(walls) - min(walls)) / statistics.median(walls)
        print(f"  N={key[0]}: wall spread (max - min) / median {spread:.1%} (goal <= 20% at 5000)")
    row("  submit -> last Pod first seen s", lambda r: r.get("last_pod_seen") or 0)
    for name in ("apiserver", "etcd", "controllers", "kwok", "harness", "machine_busy"):
        row(f"  CPU-s: {name}", lambda r, name=name: r.get("cluster", {}).get(name, 0), 0)
    row("  CPU pressure stall s (some)", lambda r: r.get("cluster", {}).get("pressure_cpu", 0), 0)
    row("  I/O pressure stall s (some)", lambda r: r.get("cluster", {}).get("pressure_io", 0), 0)
    row(
        "  etcd fsync ms mean",
        lambda r: (
            1000
            * r.get("cluster", {}).get("wal_fsync_duration_seconds_sum", 0)
            / max(1, r.get("cluster", {}).get("wal_fsync_duration_seconds_count", 0))
        ),
        2,
    )
    row(
        "report latency: last Pod terminal -> report s",
        lambda r: r["report_latency"],
        3,
        "<= 1 s at 1000, <= 2 s at 5000 (KWOK)",
    )
    row("  same, to report's reported_at s", lambda r: r["reported_at_latency"], 3)
    row("  last annotation -> report received s", lambda r: r["annotated_to_report"] or 0, 3)
    row("row latency: Pod terminal -> row, median s", lambda r: r["row_median"], 3, "<= 0.3 s")
    row("row latency p95 s", lambda r: r["row_p95"], 3)
    row("API reads per episode (all clients)", lambda r: r["reads"] / r["size"], 2)
    row(
        "  only kinds the workers make",
        lambda r: worker_kind_reads(r) / r["size"],
        2,
        "<= 1.5 at 1000 and 5000",
    )
    row("collect task copies that stood aside", lambda r: r["collect_copies"], 0)
    row("worker CPU ms/episode (all ours)", lambda r: r["cpu_ours"] / r["size"] * 1000, 1)
    row("  control + children", lambda r: r["cpu_control"] / r["size"] * 1000, 1)
    row("  collectors", lambda r: r["cpu_collectors"] / r["size"] * 1000, 1)
    row("redis-server CPU ms/episode", lambda r: r["cpu_redis"] / r["size"] * 1000, 1)
    row(
        "worker CPU / no-op chord floor",
        lambda r: r["cpu_ours"] / r["size"] * 1000 / statistics.median(floor_ms),
        2,
        "<= 1.5x",
    )
    row("peak worker RSS MB (sum of processes)", lambda r: r["rss_peak"] / MB, 0)
    row(
        "  growth over idle, MB per 1000 episodes",
        lambda r: (r["rss_peak"] - r["rss_start"]) / MB * 1000 / r["size"],
        1,
    )
    row(
        "Redis used_memory peak growth MB/1000 eps",
        lambda r: (r["redis_peak"] - r["redis_start"]) / MB * 1000 / r["size"],
        1,
    )
    print(
        f"{'no-op chord floor, N=' + str(floor_n) + ' tasks':<44}"
        f"{'workers ' + cell(floor_ms, 1) + ' ms/task':>{width * 2}}"
        f"   redis {cell(floor_redis, 1)} ms/task ({len(floor)} runs)"
    )
    print(f"Redis INFO used_memory_peak over the whole run: {used_memory_peak / MB:.1f} MB")
    print()
    lengths = [key for key in results if key not in cols]
    if lengths:
        print("cost per episode against episode length (harness annotates after the length):")
        for key in lengths:
            rs = results[key]
            print(
                f"  N={key[0]}, {key[1]:g}s episodes ({len(rs)} run{'s' * (len(rs) > 1)}): "
                f"wall {cell([r['wall'] for r in rs], 1)} s, worker CPU "
                f"{cell([r['cpu_ours'] / r['size'] * 1000 for r in rs], 1)} ms/ep "
                f"(less the idle floor {cell([r['cpu_net'] / r['size'] * 1000 for r in rs], 1)}"
                "), redis "
                f"{cell([r['cpu_redis'] / r['size'] * 1000 for r in rs], 1)} ms/ep, API reads "
                f"{cell([r['reads'] / r['size'] for r in rs])} /ep, report latency "
                f"{cell([r['report_latency'] for r in rs], 3)} s, ok "
                f"{sum(bool(r['ok']) for r in rs)}/{len(rs)}"
            )
        if len(lengths) >= 2:

            def per_episode(name: str) -> list[float]:
                return [
                    statistics.median([r[name] / r["size"] for r in results[key]])
                    for key in lengths
                ]

            cpus, nets = per_episode("cpu_ours"), per_episode("cpu_net")
            print(
                f"  longest / shortest worker CPU per episode: {cpus[-1] / cpus[0]:.2f} "
                f"(goal within 20%); less the idle floor: {nets[-1] / nets[0]:.2f}"
            )
        print()
    print(
        "guide's script, seed, 10 parallel on real nodes (side by side on the real node: "
        "python -m benchmarks.bench_real_node): "
        + ", ".join(f"{key} {value}" for key, value in GUIDE.items())
    )
    print(
        "API reads of the last run per size, by kind: "
        + "; ".join(f"N={key[0]}: {results[key][-1]['reads_by_kind']}" for key in list(results)[:3])
    )


if __name__ == "__main__":
    main()

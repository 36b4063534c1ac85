"""bench_kubernetes's report: the table of its sizes, cost against episode length, and the
guide's figures beside them (printed once the runs are done, from their JSON records)."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.harness import Columns, cell

MB = 1024 * 1024
# The guide's own figures: its script, seed, 10 parallel on real nodes.
GUIDE = {"all ready s": 3.7, "all rewards s": 8.4, "client sees Job complete s": 12.7}
Figure = Callable[[dict[str, Any]], float]


# Reads the workers never make (no GET of single Pods or of pods/status, no cluster-wide watch):
# on a shared cluster they are other sessions' (their KWOK harnesses and probes).
NOT_WORKERS = ("GET pods resource", "GET pods/status resource", "WATCH pods cluster")


def worker_kind_reads(result: dict[str, Any]) -> int:
    return sum(
        count
        for kind, count in result["reads_by_kind"].items()
        if kind not in NOT_WORKERS and (not kind.startswith("WATCH") or kind.endswith("namespace"))
    )


def print_table(
    args: argparse.Namespace,
    results: dict[tuple[int, float], list[dict[str, Any]]],
    floor: list[Any],
    floor_n: int,
    used_memory_peak: int,
) -> None:
    print()
    print(
        f"KWOK, {os.cpu_count()} cpus; workers: control prefork x2, 2 collectors threads "
        f"x{args.collect_concurrency}; parallelism min(N, {args.parallelism}); deadline "
        f"{args.deadline}s; median [min-max] of the runs"
    )
    cols = [key for key in results if key[1] == args.seconds and key[0] in args.sizes]
    print_sizes(results, cols, floor, floor_n)
    print(f"Redis INFO used_memory_peak over the whole run: {used_memory_peak / MB:.1f} MB")
    print()
    lengths = [key for key in results if key not in cols]
    if lengths:
        print_lengths(results, lengths)
    print(
        "guide's script, seed, 10 parallel on real nodes (side by side on the real node: "
        "python -m benchmarks.bench_real_node): "
        + ", ".join(f"{key} {value}" for key, value in GUIDE.items())
    )
    print(
        "API reads of the last run per size, by kind: "
        + "; ".join(f"N={key[0]}: {results[key][-1]['reads_by_kind']}" for key in list(results)[:3])
    )


def cluster_figure(name: str) -> Figure:
    return lambda r: r.get("cluster", {}).get(name, 0)


def print_sizes(
    results: dict[tuple[int, float], list[dict[str, Any]]],
    cols: list[tuple[int, float]],
    floor: list[Any],
    floor_n: int,
) -> None:
    """The table of the --sizes runs: one column per size, one row per figure."""
    floor_ms = [u.ours / floor_n * 1000 for u in floor]
    floor_redis = [u.redis / floor_n * 1000 for u in floor]
    table = Columns(label=44, width=30)
    heads = [f"N={n}, {s:g}s eps ({len(results[(n, s)])} runs)" for n, s in cols]

    def row(label: str, fn: Figure, digits: int = 2, goal: str = "", scale: float = 1.0) -> None:
        print(
            table.line(
                label, [cell([fn(r) for r in results[key]], digits, scale) for key in cols], goal
            )
        )

    def per_ep(name: str, scale: float = 1000) -> Figure:
        return lambda r: r[name] / r["size"] * scale

    print(table.line("figure", heads, "goal / reference"))
    row("ok (reward_sum = N)", lambda r: float(r["ok"] and r["reward_sum"] == r["size"]), 0)
    row("wall: submit -> report received s", lambda r: r["wall"])
    for key in cols:
        walls = [r["wall"] for r in results[key]]
        spread = (max(walls) - min(walls)) / statistics.median(walls)
        print(f"  N={key[0]}: wall spread (max - min) / median {spread:.1%} (goal <= 20% at 5000)")
    row("  submit -> last Pod first seen s", lambda r: r.get("last_pod_seen") or 0)
    for name in ("apiserver", "etcd", "controllers", "kwok", "harness", "machine_busy"):
        row(f"  CPU-s: {name}", cluster_figure(name), 0)
    row("  CPU pressure stall s (some)", cluster_figure("pressure_cpu"), 0)
    row("  I/O pressure stall s (some)", cluster_figure("pressure_io"), 0)
    row(
        "  etcd fsync ms mean",
        lambda r: (
            1000
            * cluster_figure("wal_fsync_duration_seconds_sum")(r)
            / max(1, cluster_figure("wal_fsync_duration_seconds_count")(r))
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
    row("API reads per episode (all clients)", per_ep("reads", 1), 2)
    row(
        "  only kinds the workers make",
        lambda r: worker_kind_reads(r) / r["size"],
        2,
        "<= 1.5 at 1000 and 5000",
    )
    row("collect task copies that stood aside", lambda r: r["collect_copies"], 0)
    cost_rows(row, per_ep, floor_ms)
    print(
        f"{'no-op chord floor, N=' + str(floor_n) + ' tasks':<44}"
        f"{'workers ' + cell(floor_ms, 1) + ' ms/task':>{table.width * 2}}"
        f"   redis {cell(floor_redis, 1)} ms/task ({len(floor)} runs)"
    )


def cost_rows(
    row: Callable[..., None], per_ep: Callable[..., Figure], floor_ms: list[float]
) -> None:
    """The CPU and memory rows of the sizes table."""
    row("worker CPU ms/episode (all ours)", per_ep("cpu_ours"), 1)
    row("  control + children", per_ep("cpu_control"), 1)
    row("  collectors", per_ep("cpu_collectors"), 1)
    row("redis-server CPU ms/episode", per_ep("cpu_redis"), 1)
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


def print_lengths(
    results: dict[tuple[int, float], list[dict[str, Any]]], lengths: list[tuple[int, float]]
) -> None:
    """Cost per episode against episode length: is it flat?"""
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
                statistics.median([r[name] / r["size"] for r in results[key]]) for key in lengths
            ]

        cpus, nets = per_episode("cpu_ours"), per_episode("cpu_net")
        print(
            f"  longest / shortest worker CPU per episode: {cpus[-1] / cpus[0]:.2f} "
            f"(goal within 20%); less the idle floor: {nets[-1] / nets[0]:.2f}"
        )
    print()

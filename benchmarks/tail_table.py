"""bench_tail's closing table: one column per backend, each figure's median [min-max] over the
rounds, the goal beside it and whether each backend met it."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any, Protocol

from benchmarks.harness import Stats, p95


class Bench(Protocol):
    """What the table reads of a backend's bench (bench_tail.Bench): its figures by name."""

    figures: dict[str, list[float]]


GOAL_TIME_TO_K = 0.5  # over-sampled time to K / plain, at most
GOAL_CONTINUOUS = 1.8  # continuous groups/s / synchronous, at least
GOAL_GROUP_LATENCY = 0.1  # seconds, median, at most
LABELS = {"local": "local", "kubernetes": "real node"}
COLUMNS = ["local", "kubernetes"]
WIDTH = 24


class TailTable:
    """Prints rows; keeps the figures it printed (median, and whether the goal was met)."""

    def __init__(self, benches: dict[str, Bench]) -> None:
        self.benches = benches
        self.summary: dict[str, Any] = {}

    def row(
        self, label: str, values: dict[str, str], goal: str = "", met: dict[str, bool] | None = None
    ) -> None:
        cells = "".join(f"{values.get(c, '-'):>{WIDTH}}" for c in COLUMNS)
        met = met or {}
        shown = ", ".join(
            ("yes" if met[c] else "no")
            if len(met) == 1
            else f"{LABELS[c]} {'yes' if met[c] else 'no'}"
            for c in COLUMNS
            if c in met
        )
        print(f"{label:40}{cells}   {goal:10} {shown}")

    def figure(
        self,
        label: str,
        name: str,
        goal: str = "",
        test: Callable[[float], bool] | None = None,
        digits: int = 2,
    ) -> None:
        values, met = {}, {}
        for backend, bench in self.benches.items():
            got = bench.figures.get(name)
            if not got:
                if test is not None and (name != "cont_ratio" or backend == "local"):
                    met[backend] = False  # asked for, never measured (the quota not met)
                continue
            values[backend] = Stats(got).fmt(digits=digits)
            self.summary[f"{backend}.{name}"] = statistics.median(got)
            if test is not None:
                met[backend] = self.summary[f"{backend}.{name}.met"] = test(statistics.median(got))
        self.row(label, values, goal, met)

    def group_latency(self) -> None:
        medians, p95s, met = {}, {}, {}
        for backend, bench in self.benches.items():
            got = bench.latencies
            met[backend] = bool(got) and statistics.median(got) <= GOAL_GROUP_LATENCY
            self.summary[f"{backend}.group_latency_median.met"] = met[backend]
            if got:
                medians[backend] = f"{statistics.median(got):.3f} ({len(got)} groups)"
                p95s[backend] = f"{p95(got):.3f}"
                self.summary[f"{backend}.group_latency_median"] = statistics.median(got)
                self.summary[f"{backend}.group_latency_p95"] = p95(got)
        self.row("group entry latency median s", medians, f"<= {GOAL_GROUP_LATENCY:.3f}", met)
        self.row("group entry latency p95 s", p95s)


def print_table(
    benches: dict[str, Bench],
    args: argparse.Namespace,
    loads: list[Any],
    slow_fraction: float,
    slow_factor: float,
) -> dict[str, Any]:
    """The closing table; returns its figures (for the JSON lines)."""
    table = TailTable(benches)
    print(
        f"\n{args.samples} samples per task, turn {args.turn_seconds} s, {slow_fraction:.0%} "
        f"of samples slow x{slow_factor:g}; {args.rounds} rounds: median [min-max]"
    )
    print(
        f"{'measure':40}" + "".join(f"{LABELS[c]:>{WIDTH}}" for c in COLUMNS) + "   goal       met"
    )
    table.row(
        "parallelism: plain / over-sampled",
        {
            b: f"{x.parallelism.get('plain')} / {x.parallelism.get('over')}"
            for b, x in benches.items()
        },
    )
    table.figure("plain: submit -> report s", "plain")
    table.figure("over-sampled: submit -> K-th group s", "kth")
    table.figure("over-sampled: submit -> report s", "over_report")
    table.figure(
        "time to K: over-sampled / plain",
        "ratio",
        f"<= {GOAL_TIME_TO_K:.2f}",
        lambda m: m <= GOAL_TIME_TO_K,
    )
    table.figure("synchronous groups/s", "sync_gps", digits=3)
    table.figure("continuous groups/s", "cont_gps", digits=3)
    table.figure(
        "continuous / synchronous",
        "cont_ratio",
        f">= {GOAL_CONTINUOUS:.2f}",
        lambda m: m >= GOAL_CONTINUOUS,
    )
    table.group_latency()
    print(f"load average at start {loads[0]}, at end {loads[1]} ({os.cpu_count()} cpus)")
    return table.summary

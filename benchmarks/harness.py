"""What every benchmark sets up around its measurement, written once.

A figure here is the median of at least three rounds, shown as `median [min-max]`; the load
average goes with it (a figure taken on a busy machine is not one taken alone); tables are fixed
width text; a run's records are JSON. The stacks: a LocalStack's worker roles and its Redis for a
`proc.Meter`. Whether the machine is quiet before a measurement (`proc.settle`,
`proc.machine_busy_seconds`) stays in proc.py, beside the other readings of /proc.
What is measured stays in each benchmark: this module only counts, arranges and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rollout_wire import constants as k
from rollout_worker.cli.stack import LocalStack

MIN_ROUNDS = 3  # a figure is a median of at least this many rounds


@dataclass
class Stats:
    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def fmt(self, scale: float = 1.0, digits: int = 2) -> str:
        lo, mid, hi = (v * scale for v in (min(self.values), self.median, max(self.values)))
        return f"{mid:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def cell(
    values: Iterable[float | None] | None, digits: int = 2, scale: float = 1.0, one_run: bool = True
) -> str:
    """A table cell: `median [min-max]` of the values that were measured (None and NaN are
    not), "-" if none was; a single value is marked "(1 run)" unless `one_run` is False."""
    got = [v for v in values or () if v is not None and not math.isnan(v)]
    if not got:
        return "-"
    if len(got) == 1 and one_run:
        return f"{got[0] * scale:.{digits}f} (1 run)"
    return Stats(got).fmt(scale=scale, digits=digits)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank at q * (n - 1), rounded: the value a q-share of the others lie under."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def p95(values: Sequence[float]) -> float:
    return percentile(values, 0.95)


def require_rounds(
    parser: argparse.ArgumentParser, rounds: int, flag: str = "--rounds", minimum: int = MIN_ROUNDS
) -> None:
    if rounds < minimum:
        parser.error(f"{flag} must be at least {minimum} (figures are medians of rounds)")


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring is its --help."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


@dataclass
class Loads:
    """The load average at the start of a benchmark and at its end, printed with the figures."""

    start: tuple[float, float, float] = field(default_factory=lambda: os.getloadavg())
    end: tuple[float, float, float] | None = None

    def stop(self) -> Loads:
        self.end = os.getloadavg()
        return self

    def line(self) -> str:
        return f"load average at start {self.start}, at end {self.end}"


class Figures:
    """Named figures, one value per round, kept in the order they were first added."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def __getitem__(self, name: str) -> list[float]:
        return self.values[name]

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])

    def lines(self, width: int = 40, digits: int = 3, indent: str = "  ") -> list[str]:
        """`name median [min-max]` each; a name ending in % is shown in percent."""
        return [
            f"{indent}{name:{width}} "
            + Stats(values).fmt(scale=100 if name.endswith("%") else 1, digits=digits)
            for name, values in self.values.items()
        ]


@dataclass(frozen=True)
class Columns:
    """A fixed-width text table: a left-aligned label, right-aligned cells, a note after."""

    label: int = 44
    width: int = 30

    def line(self, label: str, cells: Iterable[str], note: str = "") -> str:
        cells_text = "".join(f"{c:>{self.width}}" for c in cells)
        return f"{label:<{self.label}}{cells_text}   {note}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def append_json(handle: IO[str], record: Any) -> None:
    """One JSON line, flushed: a run's record survives a later run's crash."""
    handle.write(json.dumps(record) + "\n")
    handle.flush()


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def worker_roles(stack: LocalStack) -> dict[str, list[int]]:
    """A LocalStack's worker pids by the role a `proc.Meter` counts them under."""
    return {
        "control": [w.proc.pid for w in stack.workers if w.queue == k.QUEUE_CONTROL],
        "collectors": [w.proc.pid for w in stack.workers if w.queue == k.QUEUE_COLLECT],
    }


def redis_pid(stack: LocalStack) -> int | None:
    """The stack's own redis-server (None when it uses one it did not start)."""
    return stack.redis_proc.pid if stack.redis_proc else None

"""The guide's metric definitions over validated episode rows. Pure functions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rollout_wire.rows import EpisodeRow


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 1]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 1:
        raise ValueError(f"q must be within [0, 1], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    lo, hi = math.floor(position), math.ceil(position)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def spread(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {
            f"{prefix}_p50_seconds": None,
            f"{prefix}_p95_seconds": None,
            f"{prefix}_max_seconds": None,
        }
    return {
        f"{prefix}_p50_seconds": percentile(values, 0.5),
        f"{prefix}_p95_seconds": percentile(values, 0.95),
        f"{prefix}_max_seconds": max(values),
    }


def phase_breakdown(rows: Sequence[EpisodeRow]) -> dict[str, Any]:
    """p50/p95/max of each per-episode phase the backend timed (scheduling, start, init...)."""
    phases: dict[str, list[float]] = {}
    for row in rows:
        for name, value in row.timing.items():
            if value is not None and name.endswith("_seconds"):
                phases.setdefault(name[: -len("_seconds")], []).append(value)
    return {
        name: {"p50": percentile(v, 0.5), "p95": percentile(v, 0.95), "max": max(v), "n": len(v)}
        for name, v in sorted(phases.items())
    }


def busy_span(
    ready_at: float | None,
    finished_at: float | None,
    collected_at: float | None,
    reward_at: float | None = None,
) -> tuple[float, float] | None:
    """When an episode kept its slot busy with episode work: from its sandbox being ready to
    it finishing (collected, when it was stopped before it could say). Start-up is left out on
    purpose: a slot waiting on a sandbox to start does no episode work, so utilisation shows
    start-up as idle along with the gaps between episodes. The finish is never before the
    runner's reward: Kubernetes gives a container's finish in whole seconds (cut down), which
    can fall before the reward the runner timed, even before it was ready."""
    end = finished_at if finished_at is not None else collected_at
    if end is not None and reward_at is not None:
        end = max(end, reward_at)
    if ready_at is None or end is None or end < ready_at:
        return None
    return ready_at, end


def slot_utilisation(
    spans: Sequence[tuple[float, float]], parallelism: int | None, origin: float | None
) -> float | None:
    """Busy slot-seconds over the slots there were: the sum of the episodes' busy spans
    divided by parallelism x (the run's origin -> its last episode finishing). None when there
    is nothing to measure."""
    if not spans or not parallelism or parallelism <= 0 or origin is None:
        return None
    end = max(stop for _, stop in spans)
    if end <= origin:
        return None
    busy = sum(max(0.0, stop - max(start, origin)) for start, stop in spans)
    return busy / (parallelism * (end - origin))


def busy_slots(spans: Sequence[tuple[float, float]]) -> list[tuple[float, int]]:
    """The number of busy slots over time, as steps: [(moment, slots busy from then on)]."""
    changes: dict[float, int] = {}
    for start, stop in spans:
        changes[start] = changes.get(start, 0) + 1
        changes[stop] = changes.get(stop, 0) - 1
    steps, busy = [], 0
    for moment in sorted(changes):
        busy += changes[moment]
        steps.append((moment, busy))
    return steps

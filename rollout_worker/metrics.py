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

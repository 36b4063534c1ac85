"""Batch metrics and the report, computed from validated episode rows. Pure functions."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollout_worker.models import BatchSpec, EpisodeRow


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


def dedupe_rows(rows: Iterable[EpisodeRow]) -> dict[int, EpisodeRow]:
    """One row per episode index (the first one recorded wins)."""
    by_index: dict[int, EpisodeRow] = {}
    for row in rows:
        by_index.setdefault(row.index, row)
    return by_index


def _spread(values: list[float], prefix: str) -> dict[str, float | None]:
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


def build_report(
    spec: BatchSpec,
    rows: Iterable[EpisodeRow],
    *,
    origin: float,
    batch_errors: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The batch report: the guide's metrics, per-episode rows, and an explicit verdict."""
    by_index = dedupe_rows(rows)
    errors = list(batch_errors)
    missing = [i for i in range(spec.count) if i not in by_index]
    if missing:
        errors.append(f"{len(missing)} episode(s) never collected: indexes {missing[:20]}")
    unexpected = sorted(i for i in by_index if not 0 <= i < spec.count)
    if unexpected:
        errors.append(f"rows for unknown episode indexes {unexpected[:20]}")
    ordered = [by_index[i] for i in sorted(by_index)]
    for row in ordered:
        if not row.ok:
            errors.append(f"episode {row.index} ({row.pod}) {row.status}: {'; '.join(row.errors)}")

    ok_rows = [r for r in ordered if r.ok]
    ready = [r.batch_to_ready_seconds for r in ordered if r.batch_to_ready_seconds is not None]
    rewards = [r.batch_to_reward_seconds for r in ordered if r.batch_to_reward_seconds is not None]
    startup = [r.pod_to_ready_seconds for r in ordered if r.pod_to_ready_seconds is not None]
    nodes: dict[str, int] = {}
    images: set[str] = set()
    for row in ordered:
        if row.node:
            nodes[row.node] = nodes.get(row.node, 0) + 1
        if row.image_id:
            images.add(row.image_id)

    successful = len(ok_rows)
    ok = not errors and successful == spec.count
    report: dict[str, Any] = {
        "batch_id": spec.batch_id,
        "ok": ok,
        "status": "succeeded" if ok else "failed",
        "errors": errors,
        "episodes": spec.count,
        "collected_episodes": len(ordered),
        "successful_episodes": successful,
        "failed_episodes": sum(1 for r in ordered if r.status == "failed"),
        "lost_episodes": sum(1 for r in ordered if r.status == "lost") + len(missing),
        "reward_sum": sum(r.reward for r in ok_rows),
        "parallelism": spec.parallelism,
        "backend": spec.backend,
        "image": spec.image,
        "runtime": spec.runtime,
        "action": spec.action,
        "labels": dict(spec.labels),
        "batch_to_all_ready_seconds": max(ready) if ready else None,
        "batch_to_all_rewards_seconds": max(rewards) if rewards else None,
        **_spread(startup, "pod_to_ready"),
        "phases": phase_breakdown(ordered),
        "nodes": nodes,
        "image_ids": sorted(images),
        "submitted_at": spec.submitted_at,
        "run_created_at": origin,
        "pods": [r.to_dict() for r in ordered],
    }
    if extra:
        report.update(extra)
    return report


def error_report(
    batch_id: str, status: str, errors: Sequence[str], request: Mapping[str, Any]
) -> dict[str, Any]:
    """The report of a batch that never ran (rejected request, backend refused to start)."""
    count = request.get("count")
    return {
        "batch_id": batch_id,
        "ok": False,
        "status": status,
        "errors": list(errors),
        "episodes": count if isinstance(count, int) else None,
        "collected_episodes": 0,
        "successful_episodes": 0,
        "failed_episodes": 0,
        "lost_episodes": 0,
        "reward_sum": 0,
        "backend": request.get("backend"),
        "pods": [],
    }


def summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report without its per-episode rows (what the CLI prints)."""
    return {k: v for k, v in report.items() if k not in ("pods", "errors")} | {
        "errors": list(report.get("errors", []))[:10]
    }

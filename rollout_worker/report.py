"""The batch report, built in one place: verdict, the guide's metrics, run identity and
per-episode rows. Pure: it reads rows and the run's facts, it writes nothing."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_wire.request import BatchSpec
from rollout_wire.rows import COST_COUNTS, COST_PEAK, COST_PHASES, COST_SECONDS, EpisodeRow
from rollout_wire.states import (
    BatchStatus,
    EpisodeStatus,
    FailureKind,
    GroupStatus,
    RunVerdict,
)
from rollout_worker.backends.base import FinishedRun, KubeRunHandle, RunHandle
from rollout_worker.metrics import busy_span, phase_breakdown, slot_utilisation, spread


def dedupe_rows(rows: Iterable[EpisodeRow]) -> dict[int, EpisodeRow]:
    """One row per episode index (the first one recorded wins)."""
    by_index: dict[int, EpisodeRow] = {}
    for row in rows:
        by_index.setdefault(row.index, row)
    return by_index


@dataclass(frozen=True)
class _Rows:
    """A batch's rows, read once: what each section of the report counts from."""

    by_index: dict[int, EpisodeRow]
    ordered: list[EpisodeRow]  # by episode index
    missing: list[int]  # indexes of the batch no row came for
    ok_rows: list[EpisodeRow]
    withdrawn: list[EpisodeRow]  # aborted or stale: neither a failure nor a reward

    @classmethod
    def of(cls, spec: BatchSpec, rows: Iterable[EpisodeRow]) -> _Rows:
        by_index = dedupe_rows(rows)
        ordered = [by_index[i] for i in sorted(by_index)]
        return cls(
            by_index=by_index,
            ordered=ordered,
            missing=[i for i in range(spec.count) if i not in by_index],
            ok_rows=[r for r in ordered if r.ok],
            withdrawn=[r for r in ordered if r.status.withdrawn],
        )

    @property
    def reward_sum(self) -> float:
        return sum(r.reward for r in self.ok_rows)


def build_report(
    spec: BatchSpec,
    rows: Iterable[EpisodeRow],
    run: RunHandle,
    finished: FinishedRun | None,
    *,
    finalized_by: str,
    reported_at: float,
    warnings: Sequence[str] = (),
    batch_errors: Sequence[str] = (),
    counted: Sequence[str] = (),
) -> dict[str, Any]:
    """The report of a batch that ran. `finished` is None when the run's records could not be
    read (`batch_errors` then says why). `counted`: the groups that made a quota
    (`groups_wanted`), in the order they completed.

    Assembled from its sections in the report's key order (a later section never repeats an
    earlier key, except a run fact named like one: it keeps its place, the later value wins,
    as in one dict literal)."""
    read = _Rows.of(spec, rows)
    groups = build_groups(spec, read.by_index)
    errors = _errors(spec, read, finished, batch_errors)
    quota = _quota(spec, read.ordered, groups, counted)
    return {
        **_verdict_section(spec, read, errors, warnings, quota),
        **_episodes_section(spec, read),
        **_trainer_section(spec, groups, quota),
        **_capacity_section(spec, read, run),
        **_request_section(spec),
        **_identity_section(run, finished),
        **_timing_section(spec, read, run, finished),
        "reported_at": reported_at,
        "finalized_by": finalized_by,
        "pods": [r.to_dict() for r in read.ordered],
    }


def _errors(
    spec: BatchSpec, read: _Rows, finished: FinishedRun | None, batch_errors: Sequence[str]
) -> list[str]:
    """Why the batch failed, if it did: rows missing or unknown, episodes that failed, a run
    that ended Failed, an episode that ran what the batch did not assign it."""
    errors = list(batch_errors)
    if read.missing:
        errors.append(
            f"{len(read.missing)} episode(s) never collected: indexes {read.missing[:20]}"
        )
    unexpected = sorted(i for i in read.by_index if not 0 <= i < spec.count)
    if unexpected:
        errors.append(f"rows for unknown episode indexes {unexpected[:20]}")
    for row in read.ordered:
        if not (row.ok or row.status.withdrawn):
            errors.append(f"episode {row.index} ({row.pod}) {row.status}: {'; '.join(row.errors)}")
    aborted = any(r.status == EpisodeStatus.ABORTED for r in read.by_index.values())
    if finished is not None and finished.verdict == RunVerdict.FAILED and not aborted:
        # (Stopping the rest of a batch that had its groups ends the run Failed: no error.)
        errors.append("the run ended Failed (the guide requires the Job to end Complete)")
    for row in read.ordered:
        if row.group_id is not None and 0 <= row.index < spec.count:
            expected = spec.episode(row.index)
            if (row.group_id, row.task_id, row.sample) != (
                expected.group_id,
                expected.task_id,
                expected.sample,
            ):
                errors.append(
                    f"episode {row.index} ran task {row.task_id!r} sample {row.sample!r} "
                    f"(group {row.group_id!r}), the batch assigned {expected.task_id!r} "
                    f"sample {expected.sample} (group {expected.group_id!r})"
                )
    return errors


def _verdict_section(
    spec: BatchSpec,
    read: _Rows,
    errors: list[str],
    warnings: Sequence[str],
    quota: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Whether the batch did its job, and why not."""
    if quota is None:
        ok = not errors and len(read.ok_rows) + len(read.withdrawn) == spec.count
        status = BatchStatus.SUCCEEDED if ok else BatchStatus.FAILED
    else:
        # The trainer asked for groups, not episodes: the batch did its job when enough
        # groups passed, whatever became of the rest (their errors are still listed).
        ok = quota["met"]
        status = BatchStatus.SUCCEEDED if ok else BatchStatus.QUOTA_NOT_MET
    return {
        "batch_id": spec.batch_id,
        "ok": ok,
        "status": status,
        "errors": errors,
        # What loading the tasks warned of first (keys let through, keys not enforced).
        "warnings": [*spec.task_warnings, *warnings, *_artifact_warnings(read)],
    }


def _artifact_warnings(read: _Rows) -> list[str]:
    """One line when episodes had artifacts refused: they still count, the files are lost."""
    refused = [(r.index, r.artifacts_refused) for r in read.ordered if r.artifacts_refused]
    if not refused:
        return []
    index, reasons = refused[0]
    more = " ..." if len(reasons) > 1 else ""
    return [
        f"{len(refused)} episode(s) had artifacts refused (episode {index}: {reasons[0]!r}{more})"
    ]


def _episodes_section(spec: BatchSpec, read: _Rows) -> dict[str, Any]:
    """How the episodes ended, and the retries they took."""
    ordered, withdrawn, missing = read.ordered, read.withdrawn, read.missing
    return {
        "episodes": spec.count,
        "collected_episodes": len(ordered),
        "successful_episodes": len(read.ok_rows),
        "failed_episodes": sum(1 for r in ordered if r.status == EpisodeStatus.FAILED),
        "lost_episodes": sum(1 for r in ordered if r.status == EpisodeStatus.LOST) + len(missing),
        "aborted_episodes": sum(1 for r in withdrawn if r.status == EpisodeStatus.ABORTED),
        "stale_episodes": sum(1 for r in withdrawn if r.status == EpisodeStatus.STALE),
        "reward_sum": read.reward_sum,
        "infrastructure_failures": sum(
            1 for r in ordered if r.failure_kind == FailureKind.INFRASTRUCTURE
        )
        + len(missing),
        "episode_failures": sum(1 for r in ordered if r.failure_kind == FailureKind.EPISODE),
        # The retry budget per episode and what it cost: episodes run again, and attempts.
        "infra_retries": spec.infra_retries,
        "retried_episodes": sum(1 for r in ordered if r.retried),
        "retries": sum(len(r.retried) for r in ordered),
        "artifacts_refused_episodes": sum(1 for r in ordered if r.artifacts_refused),
    }


def _trainer_section(
    spec: BatchSpec, groups: list[dict[str, Any]], quota: dict[str, Any] | None
) -> dict[str, Any]:
    """What the trainer asked for and gets back: samples per task, policy, groups, quota."""
    return {
        "samples_per_task": spec.samples_per_task if spec.tasks else spec.count,
        "policy": {"url": spec.policy.url, "model": spec.policy.model} if spec.policy else None,
        "groups": groups,
        "quota": quota,
        "policy_version": spec.policy_version,
    }


def _capacity_section(spec: BatchSpec, read: _Rows, run: RunHandle) -> dict[str, Any]:
    """How the batch used its slots, and what it cost."""
    spans = [
        span
        for r in read.ordered
        if (span := busy_span(r.ready_at, r.finished_at, r.collected_at, r.reward_at)) is not None
    ]
    return {
        "parallelism": spec.parallelism,
        # Episodes that ran in a sandbox taken from a warm pool (the rest started cold).
        "warm_episodes": sum(1 for r in read.ordered if "pool_created_at" in r.timing),
        # Busy slot-seconds (ready -> finished, metrics.busy_span) over parallelism x the
        # batch's wall (the run's origin -> its last episode finishing).
        "slot_utilisation": slot_utilisation(spans, spec.parallelism, run.origin),
        "cost": cost_figures(read.ordered, read.reward_sum),
    }


def _request_section(spec: BatchSpec) -> dict[str, Any]:
    """What ran: backend, isolation, image, runtime, action, labels (as the request gave
    them)."""
    return {
        "backend": spec.backend,
        "isolation": spec.isolation,
        "image": spec.image,
        "runtime": spec.runtime,
        "action": spec.action,
        "labels": dict(spec.labels),
    }


def _identity_section(run: RunHandle, finished: FinishedRun | None) -> dict[str, Any]:
    """The guide's run identity: where it ran, and an image cache we do not control."""
    return {
        "context": run.context,
        "namespace": run.namespace if isinstance(run, KubeRunHandle) else None,
        "cache_state": "uncontrolled",
        "run": run.to_dict(),
        "run_verdict": finished.verdict if finished else RunVerdict.UNKNOWN,
        **{f"run_{name}": value for name, value in (finished.facts if finished else {}).items()},
    }


def _timing_section(
    spec: BatchSpec, read: _Rows, run: RunHandle, finished: FinishedRun | None
) -> dict[str, Any]:
    """When things happened: readiness, rewards, the run's end, phases, nodes and images."""
    ordered = read.ordered
    ready = [r.batch_to_ready_seconds for r in ordered if r.batch_to_ready_seconds is not None]
    rewards = [r.batch_to_reward_seconds for r in ordered if r.batch_to_reward_seconds is not None]
    startup = [r.pod_to_ready_seconds for r in ordered if r.pod_to_ready_seconds is not None]
    nodes: dict[str, int] = {}
    for row in ordered:
        if row.node:
            nodes[row.node] = nodes.get(row.node, 0) + 1
    completed_at = finished.completed_at if finished else None
    return {
        "batch_to_all_ready_seconds": max(ready) if ready else None,
        "batch_to_all_rewards_seconds": max(rewards) if rewards else None,
        **spread(startup, "pod_to_ready"),
        # Run created -> the backend saw the run end (the Job's Complete/Failed condition).
        "job_complete_seconds": completed_at - run.origin if completed_at else None,
        "completed_at": completed_at,
        "phases": phase_breakdown(ordered),
        "nodes": nodes,
        "image_ids": sorted({r.image_id for r in ordered if r.image_id}),
        "submitted_at": spec.submitted_at,
        "run_created_at": run.origin,
    }


def episode_seconds(row: EpisodeRow) -> float | None:
    """How long the episode's sandbox ran: created -> finished (collected, when it was stopped
    before it could say)."""
    end = row.finished_at or row.collected_at
    if row.created_at is None or end is None:
        return None
    return max(0.0, end - row.created_at)


def _quota(
    spec: BatchSpec,
    rows: Sequence[EpisodeRow],
    groups: Sequence[Mapping[str, Any]],
    counted: Sequence[str],
) -> dict[str, Any] | None:
    """Which groups counted, which were cut, and what the cut saved, as bounds (what a cut
    episode would have taken is unknowable): at least, each aborted episode would have run as
    long as the median finished one (those cut were the slow ones) minus what it had run, so
    one never started saves the whole median; at most, each would have run to its timeout."""
    if not spec.groups_wanted:
        return None
    aborted = [r for r in rows if r.status == EpisodeStatus.ABORTED]
    finished = [s for r in rows if r.ok and (s := episode_seconds(r)) is not None]
    typical = statistics.median(finished) if finished else 0.0
    used = [episode_seconds(r) or 0.0 for r in aborted]
    return {
        "groups_wanted": spec.groups_wanted,
        "group_filter": spec.group_filter,
        "met": len(counted) >= spec.groups_wanted,
        "counted": list(counted),
        "cut": [
            g["group_id"]
            for g in groups
            if any(w["status"] == EpisodeStatus.ABORTED for w in g["withdrawn"])
        ],
        "aborted_episodes": len(aborted),
        "aborted_sandbox_seconds": sum(used),
        "saved_sandbox_seconds_at_least": sum(max(0.0, typical - u) for u in used),
        "saved_sandbox_seconds_at_most": sum(
            max(0.0, spec.episode_timeout_seconds - u) for u in used
        ),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c passed: the chance that at
    least one of k samples drawn without replacement passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def build_groups(spec: BatchSpec, by_index: Mapping[int, EpisodeRow]) -> list[dict[str, Any]]:
    """Every task's group (`group_figures`), in the batch's task order."""
    return [group_figures(spec, spec.group_of(start), by_index) for start in group_starts(spec)]


def group_starts(spec: BatchSpec) -> range:
    """The first index of each group."""
    return range(0, spec.count, spec.samples_per_task if spec.tasks else spec.count)


def group_figures(
    spec: BatchSpec, indexes: Sequence[int], by_index: Mapping[int, EpisodeRow]
) -> dict[str, Any]:
    """One task's group: its group id, samples (the episodes the batch assigned it), the
    rewards of its valid samples, mean and population standard deviation, pass@k (a sample
    passes with reward 1) for k = 1, 2, 4, ... up to the valid samples, and `varied` (at least
    two distinct rewards). Failed and lost episodes are listed with their kind and cause and
    enter no figure: an infrastructure failure is not a reward-0 sample. Aborted and stale
    ones are listed apart (`withdrawn`): neither a failure nor a reward.

    Status: `complete` when every sample is valid; `failed` when an infrastructure failure is
    left after the retry budget (no fair group for group-relative advantages); `aborted` when a
    sample was withdrawn (the quota cut it, or it was stale); else `incomplete` (some sample
    broke a rule of the episode)."""
    rows = [by_index.get(i) for i in indexes]
    valid = [r for r in rows if r is not None and r.ok]
    rewards = [r.reward for r in valid]
    passed = sum(1 for value in rewards if value >= 1)
    n = len(valid)
    withdrawn = [
        {"index": r.index, "sample": r.sample, "status": r.status}
        for r in rows
        if r is not None and r.status.withdrawn
    ]
    failed = [
        {
            "index": i,
            "sample": spec.episode(i).sample,
            "status": r.status if r is not None else EpisodeStatus.LOST,
            "failure_kind": (r.failure_kind if r is not None else None)
            or FailureKind.INFRASTRUCTURE,
            "cause": (r.failure_cause if r is not None else None) or "never collected",
        }
        for i, r in zip(indexes, rows, strict=True)
        if r is None or not (r.ok or r.status.withdrawn)
    ]
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, n) if 1 <= k <= n})
    if any(f["failure_kind"] == FailureKind.INFRASTRUCTURE for f in failed):
        status = GroupStatus.FAILED
    elif withdrawn:
        status = GroupStatus.ABORTED
    elif failed:
        status = GroupStatus.INCOMPLETE
    else:
        status = GroupStatus.COMPLETE
    versions = [r.policy_versions for r in rows if r is not None and r.policy_versions]
    first = spec.episode(indexes[0])
    return {
        "group_id": first.group_id,
        "task_id": first.task_id,
        "samples": len(indexes),
        "indexes": list(indexes),
        "valid_samples": n,
        "rewards": rewards,
        "mean": statistics.fmean(rewards) if rewards else None,
        "std": statistics.pstdev(rewards) if rewards else None,
        "varied": len(set(rewards)) >= 2,
        "pass_at_k": {str(k): pass_at_k(n, passed, k) for k in ks},
        "failed": failed,
        "withdrawn": withdrawn,
        "retries": sum(len(r.retried) for r in rows if r is not None),
        "cost": cost_figures([r for r in rows if r is not None], sum(rewards)),
        # The spread of policy versions its samples saw: (oldest first turn, newest last turn).
        "policy_versions": _version_spread(versions),
        **_step_figures(valid),
        "status": status,
    }


def _step_figures(valid: Sequence[EpisodeRow]) -> dict[str, Any]:
    """A task with steps: each step's mean reward over the valid samples that ran it, and how
    many did (a step a min_reward gated off is left out, as from the reward); {} otherwise."""
    runs: dict[str, list[float]] = {}
    for row in valid:
        for step in row.step_rewards or ():
            runs.setdefault(str(step["name"]), []).append(float(step["reward"]))
    if not runs:
        return {}
    return {
        "step_rewards": [
            {"name": name, "runs": len(values), "mean": statistics.fmean(values)}
            for name, values in runs.items()
        ]
    }


def _known(values: Iterable[Any]) -> list[float]:
    return [
        v  # as they are: counts stay integers
        for v in values
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _total(values: Iterable[Any]) -> float | None:
    """The sum of the known values; None when none is known."""
    known = _known(values)
    return sum(known) if known else None


def cost_figures(rows: Sequence[EpisodeRow], reward_sum: float) -> dict[str, Any]:
    """What `rows` cost: each ledger figure summed over the rows that measured it (failed
    episodes included: their CPU and tokens were spent too), the largest peak memory, sandbox
    seconds per phase, and the cost per unit of reward (None unless reward_sum > 0).
    `ledgers`: how many rows carry a ledger at all."""
    ledgers = [r.cost for r in rows if isinstance(r.cost, dict)]
    figures: dict[str, Any] = {"ledgers": len(ledgers), "episodes": len(rows)}
    for name in (*COST_SECONDS, *COST_COUNTS):
        figures[name] = _total(ledger.get(name) for ledger in ledgers)
    peaks = _known(ledger.get(COST_PEAK) for ledger in ledgers)
    figures[COST_PEAK] = max(peaks) if peaks else None
    prompt, completion = figures["prompt_tokens"], figures["completion_tokens"]
    tokens = None if prompt is None and completion is None else (prompt or 0) + (completion or 0)
    figures["tokens"] = tokens
    walls = [w for ledger in ledgers if isinstance(w := ledger.get("wall"), dict)]
    figures["wall"] = {phase: _total(w.get(phase) for w in walls) for phase in COST_PHASES}
    cpu = figures["cpu_seconds"]
    per_reward = reward_sum > 0
    figures["cpu_seconds_per_reward"] = cpu / reward_sum if per_reward and cpu is not None else None
    figures["tokens_per_reward"] = (
        tokens / reward_sum if per_reward and tokens is not None else None
    )
    return figures


def _version_spread(versions: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """{"first", "last"} over the samples' versions (numerically when all are integers)."""
    firsts = [v.get("first") for v in versions if v.get("first") is not None]
    lasts = [v.get("last") for v in versions if v.get("last") is not None]
    if not firsts and not lasts:
        return None

    def key(value: Any) -> tuple[int, Any]:
        text = str(value)
        return (0, int(text)) if text.lstrip("-").isdigit() else (1, text)

    return {
        "first": min(firsts, key=key) if firsts else None,
        "last": max(lasts, key=key) if lasts else None,
    }


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
        "episodes": count if isinstance(count, int) and not isinstance(count, bool) else None,
        "collected_episodes": 0,
        "successful_episodes": 0,
        "failed_episodes": 0,
        "lost_episodes": 0,
        "reward_sum": 0,
        "backend": request.get("backend") if isinstance(request.get("backend"), str) else None,
        "pods": [],
    }


def summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report without its per-episode rows (what the CLI prints)."""
    return {k: v for k, v in report.items() if k not in ("pods", "errors")} | {
        "errors": list(report.get("errors", []))[:10]
    }

"""How a run ended, read from its Jobs and its warm Pods (as JSON dicts). Pure: the backend
lists the objects, these functions decide. A Job's verdict, the Job of an episode and what it
says of that episode (one read, `index_in_job`), a run's verdict over its Jobs and warm Pods.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from rollout_wire.states import RunVerdict
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube.objects import FIRST_INDEX_LABEL
from rollout_worker.backends.kube.read import ts
from rollout_worker.observation import EpisodeObservation


def job_verdict(job: dict[str, Any]) -> tuple[float | None, RunVerdict]:
    """(when, COMPLETE | FAILED) once the Job has finished, (when, SUSPENDED) once a
    cancelled Job stopped its Pods, else (None, RUNNING)."""
    conditions = [
        c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"
    ]
    # The condition types are the verdicts' values (the enum takes the controller's words).
    for wanted in ((RunVerdict.COMPLETE, RunVerdict.FAILED), (RunVerdict.SUSPENDED,)):
        for condition in conditions:
            if condition.get("type") in wanted:
                return ts(condition.get("lastTransitionTime")), RunVerdict(condition["type"])
    return None, RunVerdict.RUNNING


def jobs_verdict(jobs: list[dict[str, Any]]) -> tuple[float | None, RunVerdict]:
    """job_verdict of a run's Jobs together: Running while any runs; Complete when all
    completed; Suspended when every one not finished is suspended; else Failed."""
    verdicts = [job_verdict(job) for job in jobs]
    kinds = {verdict for _, verdict in verdicts}
    if not verdicts or RunVerdict.RUNNING in kinds:
        return None, RunVerdict.RUNNING
    when = max((at for at, _ in verdicts if at is not None), default=None)
    if kinds == {RunVerdict.COMPLETE}:
        return when, RunVerdict.COMPLETE
    if RunVerdict.SUSPENDED in kinds:
        return when, RunVerdict.SUSPENDED
    return when, RunVerdict.FAILED


def jobs_ended(jobs: Iterable[dict[str, Any]], names: Collection[str]) -> bool:
    """Whether each Job named has finished (or is suspended), as seen."""
    ended = {j["metadata"]["name"] for j in jobs if job_verdict(j)[1] != RunVerdict.RUNNING}
    return len(ended & set(names)) >= len(names)


def warm_ended(pods: Iterable[dict[str, Any]], claimed: int) -> bool:
    """Whether every claimed warm Pod is seen and has ended (its phase, or its containers')."""
    phases = [ended_phase(p) for p in pods]
    return len(phases) >= claimed and all(ph in ("Succeeded", "Failed") for ph in phases)


def job_of(jobs: list[dict[str, Any]], index: int) -> tuple[dict[str, Any], int] | None:
    """The Job that runs episode `index`, and the episode's completion index in it."""
    for job in jobs:
        spec = job.get("spec") or {}
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        first = int(labels.get(FIRST_INDEX_LABEL, 0))
        if first <= index < first + int(spec.get("completions") or 0):
            return job, index - first
    return None


def index_in(ranges: str, index: int) -> bool:
    """Whether `index` is in a Job's index list ("1,3-5,9", as in status.failedIndexes)."""
    for part in filter(None, ranges.split(",")):
        low, _, high = part.partition("-")
        try:
            if int(low) <= index <= int(high or low):
                return True
        except ValueError:
            continue
    return False


def in_job_order(jobs: Any, names: Collection[str]) -> list[dict[str, Any]]:
    """The Jobs of `jobs` named in `names` (a run's Job names, in creation order), in that
    order."""
    order = list(names)
    items = [j for j in jobs if j["metadata"]["name"] in order]
    return sorted(items, key=lambda j: order.index(j["metadata"]["name"]))


@dataclass(frozen=True)
class IndexInJob:
    """What an episode's Job says of it (`index_in_job`)."""

    verdict: RunVerdict  # the Job's (job_verdict)
    failed: bool  # the Job counted the episode's index failed (status.failedIndexes)
    reasons: list[str | None]  # the reasons of the Job's conditions of that verdict


def index_in_job(jobs: list[dict[str, Any]], index: int) -> IndexInJob | None:
    """What the Job that runs episode `index` says of it (None: no Job runs it)."""
    found = job_of(jobs, index)
    if found is None:
        return None
    job, local = found
    _, verdict = job_verdict(job)
    status = job.get("status") or {}
    return IndexInJob(
        verdict=verdict,
        failed=index_in(status.get("failedIndexes") or "", local),
        reasons=[
            c.get("reason") for c in status.get("conditions") or [] if c.get("type") == verdict
        ],
    )


def no_retry_coming(jobs: list[dict[str, Any]], index: int) -> bool:
    """The Job will not replace this index's failed Pod: it ended, or counted the index
    failed (its budget, as the controller counts it, is spent)."""
    state = index_in_job(jobs, index)
    return state is None or state.verdict != RunVerdict.RUNNING or state.failed


def ended_without_pod(
    jobs: list[dict[str, Any]], index: int, obs: EpisodeObservation
) -> EpisodeObservation:
    """No Pod for this index: if its Job has ended, or counted the index failed (no Pod will
    come for it, even while the Job runs on), the episode ended."""
    state = index_in_job(jobs, index)
    if state is None or (state.verdict == RunVerdict.RUNNING and not state.failed):
        return obs
    obs.phase = "Failed"
    if state.failed:
        # The Job counted this index failed: its Pod ended (failed, or was deleted) before
        # any watch of ours saw it. Waiting for the whole Job to end parked such an episode
        # for up to its deadline (a CI run's ten-round test took 632 s).
        obs.reason = f"Job {state.verdict}: its Pod failed or was deleted before it could be read"
    else:
        reasons = state.reasons
        obs.reason = (
            f"Job {state.verdict}: {reasons[0] if reasons else '?'}; no Pod of this episode "
            "is left to read"
        )
    return obs


def ended_phase(pod: dict[str, Any]) -> str | None:
    """A Pod's phase, or the one its containers already decided: the kubelet moves the phase
    about a second after the last container exits, and a run's records are read at once."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    containers = status.get("containerStatuses") or []
    if phase in ("Succeeded", "Failed") or not containers:
        return phase
    ended = [(c.get("state") or {}).get("terminated") or {} for c in containers]
    if not all(ended):
        return phase
    return "Succeeded" if all(e.get("exitCode") == 0 for e in ended) else "Failed"


def run_verdict(
    handle: KubeRunHandle, jobs: list[dict[str, Any]], warm: list[dict[str, Any]]
) -> tuple[float | None, RunVerdict]:
    """How the run ended: its Jobs' verdict, and its warm Pods' (Complete when every one
    succeeded; Running while one has not ended or has not been seen)."""
    if not handle.warm:
        return jobs_verdict(jobs)
    phases = [ended_phase(p) for p in warm]
    ended = [
        ts(s.get("state", {}).get("terminated", {}).get("finishedAt"))
        for p in warm
        for s in (p.get("status") or {}).get("containerStatuses") or []
    ]
    if len(warm) < len(handle.warm) or any(ph not in ("Succeeded", "Failed") for ph in phases):
        warm_verdict: tuple[float | None, RunVerdict] = (None, RunVerdict.RUNNING)
    else:
        when = max((t for t in ended if t is not None), default=None)
        succeeded = set(phases) == {"Succeeded"}
        warm_verdict = (when, RunVerdict.COMPLETE if succeeded else RunVerdict.FAILED)
    if not handle.job_uids():
        return warm_verdict
    at, verdict = jobs_verdict(jobs)
    if RunVerdict.RUNNING in (verdict, warm_verdict[1]):
        return None, RunVerdict.RUNNING
    when = max((t for t in (at, warm_verdict[0]) if t is not None), default=None)
    both = {verdict, warm_verdict[1]}
    if both == {RunVerdict.COMPLETE}:
        return when, RunVerdict.COMPLETE
    return when, sorted(both - {RunVerdict.COMPLETE})[0]  # Failed before Suspended, by value

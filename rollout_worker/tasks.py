"""Celery tasks: thin wiring of validation, backends, the store and metrics.

Every task is idempotent (brokers redeliver) and short (well under the visibility timeout):
- submit_batch: validate, write the receipt, start the run, fan out the collection chord.
- collect_episode (queue `collect`): wait a bounded time for one episode; if it is not done,
  requeue itself instead of holding a worker slot; else validate and record its row once.
- aggregate_batch (chord callback): build the report from the recorded rows (one per episode
  index, whatever Celery delivered twice) and publish it once.
- batch_watchdog: if the chord never completes (lost callback, crashed collector), finalise the
  batch after its deadline, so a trainer is never left waiting forever.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from celery import Celery, Task, chord, group

from rollout_worker import constants as k
from rollout_worker.backends import Backend, get_backend
from rollout_worker.errors import BackendError, InvalidSpec, TransientBackendError
from rollout_worker.metrics import build_report, error_report
from rollout_worker.models import (
    BatchSpec,
    EpisodeRow,
    is_batch_id,
    parse_spec,
    spec_from_dict,
)
from rollout_worker.settings import Settings
from rollout_worker.store import Store
from rollout_worker.validation import lost_row, validate_episode

log = logging.getLogger(__name__)

WATCHDOG_STEP_SECONDS = 60
WATCHDOG_EXTRA_SECONDS = 30
SUBMIT_RETRIES = 5
_SAFE_ID = re.compile(r"[^a-z0-9-]")


class Runtime:
    """Per-process clients (Redis, backends), created lazily after the worker forks."""

    def __init__(self, settings: Settings) -> None:
        self.pid = os.getpid()
        self.settings = settings
        self.store = Store.from_url(settings.redis_url, settings.record_ttl)
        self._backends: dict[str, Backend] = {}

    def backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = get_backend(name, self.settings)
        return self._backends[name]


def runtime(app: Celery) -> Runtime:
    current = getattr(app, "_rollout_runtime", None)
    if current is None or current.pid != os.getpid():
        current = Runtime(app.rollout_settings)
        app._rollout_runtime = current
    return current


def _give_up_at(spec: BatchSpec, handle: dict[str, Any], settings: Settings) -> float:
    return float(handle["origin"]) + spec.deadline_seconds + settings.collect_grace_seconds


def _watchdog_countdown(spec: BatchSpec, handle: dict[str, Any], settings: Settings) -> float:
    """Seconds until the watchdog should look again: at most a step, never past its due time."""
    due = _give_up_at(spec, handle, settings) + WATCHDOG_EXTRA_SECONDS
    return max(0.0, min(WATCHDOG_STEP_SECONDS, due - time.time()))


# -- submit ----------------------------------------------------------------------------------
def submit_batch(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    rt = runtime(self.app)
    request = dict(request)
    # A request without an id gets one derived from the task id, so a redelivery of the same
    # message maps to the same batch.
    request.setdefault("batch_id", _SAFE_ID.sub("", str(self.request.id).lower())[:32] or None)
    try:
        spec = parse_spec(request, max_episodes=rt.settings.max_batch_episodes)
    except InvalidSpec as exc:
        batch_id = request.get("batch_id")
        # Never answer for a batch id that a valid batch already owns.
        if is_batch_id(batch_id) and rt.store.load_receipt(batch_id) is None:
            rt.store.publish_report(
                batch_id, error_report(batch_id, "rejected", exc.problems, request)
            )
        log.warning("rejected batch %s: %s", batch_id, exc)
        return {"batch_id": batch_id, "status": "rejected", "errors": exc.problems}

    store = rt.store
    fresh = store.create_receipt(
        spec.batch_id,
        {
            "batch_id": spec.batch_id,
            "spec": spec.to_dict(),
            "backend": spec.backend,
            "received_at": time.time(),
            "task_id": self.request.id,
        },
    )
    if not fresh:
        receipt = store.load_receipt(spec.batch_id) or {}
        if _comparable(receipt.get("spec")) != _comparable(spec.to_dict()):
            log.error("batch id %s reused with a different request; ignored", spec.batch_id)
            return {"batch_id": spec.batch_id, "status": "conflict"}
        if store.has_report(spec.batch_id):
            return {"batch_id": spec.batch_id, "status": "done"}
        spec = spec_from_dict(receipt["spec"])  # keep the first delivery's submitted_at

    try:
        backend = rt.backend(spec.backend)
        warnings = backend.preflight(spec)
        handle = backend.start_run(spec, lambda fields: store.update_receipt(spec.batch_id, fields))
    except TransientBackendError as exc:
        if self.request.retries < SUBMIT_RETRIES:
            raise self.retry(countdown=2**self.request.retries, exc=exc) from exc
        return _fail(store, spec, "error", [f"backend failed after retries: {exc}"])
    except BackendError as exc:
        return _fail(store, spec, "error", [str(exc)])
    store.update_receipt(spec.batch_id, {"run": handle, "warnings": warnings})

    # Send, then flag: a crash in between re-sends the same task ids, which the result
    # backend and the per-index row store both absorb.
    if not store.has_flag(spec.batch_id, "chord"):
        _dispatch(self.app, spec, _watchdog_countdown(spec, handle, rt.settings))
        store.set_flag(spec.batch_id, "chord")
    return {"batch_id": spec.batch_id, "status": "started", "warnings": warnings}


def _comparable(spec: Any) -> Any:
    return {k_: v for k_, v in (spec or {}).items() if k_ != "submitted_at"}


def _fail(store: Store, spec: BatchSpec, status: str, errors: list[str]) -> dict[str, Any]:
    store.publish_report(spec.batch_id, error_report(spec.batch_id, status, errors, spec.to_dict()))
    return {"batch_id": spec.batch_id, "status": status, "errors": errors}


def _dispatch(app: Celery, spec: BatchSpec, watchdog_countdown: float) -> None:
    batch_id = spec.batch_id
    header = group(
        [
            app.signature(
                k.TASK_COLLECT,
                args=(batch_id, index),
                queue=k.QUEUE_COLLECT,
                task_id=k.collect_task_id(batch_id, index),
            )
            for index in range(spec.count)
        ],
        task_id=k.group_id(batch_id),
    )
    body = app.signature(k.TASK_AGGREGATE, args=(batch_id,), queue=k.QUEUE_CONTROL)
    chord(header, body).apply_async(task_id=k.aggregate_task_id(batch_id))
    app.signature(k.TASK_WATCHDOG, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async(
        task_id=k.watchdog_task_id(batch_id), countdown=watchdog_countdown
    )


# -- collect ---------------------------------------------------------------------------------
class NotYet(Exception):
    """The episode is still running and its batch is within its deadline."""


def observe_and_record(
    rt: Runtime,
    batch_id: str,
    spec: BatchSpec,
    handle: dict[str, Any],
    index: int,
    block: float,
    final: bool,
) -> EpisodeRow:
    """Collect one episode: validate it if it ended, else (when `final` or past the deadline)
    record it as lost, else raise NotYet. The first row recorded for an index wins."""
    backend = rt.backend(handle["backend"])
    try:
        obs = backend.wait_episode(handle, index, block)
        if obs.terminal:
            log_text = backend.read_output(handle, obs)
            row = validate_episode(obs, log_text, float(handle["origin"]))
        elif not final and time.time() < _give_up_at(spec, handle, rt.settings):
            if obs.phase == "Running":
                rt.store.publish_state(batch_id, index, "running")
            raise NotYet
        else:
            log_text = ""
            row = lost_row(
                index,
                obs.episode_id,
                f"still {obs.phase} {spec.deadline_seconds}s after the run started "
                "(deadline) and the collection grace period",
                obs,
            )
    except TransientBackendError:
        if not final and time.time() < _give_up_at(spec, handle, rt.settings):
            raise
        row, log_text = (
            lost_row(
                index,
                backend.episode_id(handle, index),
                "the backend kept failing until the deadline",
                None,
            ),
            "",
        )
    except BackendError as exc:
        row, log_text = lost_row(index, backend.episode_id(handle, index), str(exc), None), ""
    rt.store.record_episode(batch_id, row, log_text)
    return row


def collect_episode(self: Task, batch_id: str, index: int) -> dict[str, Any]:
    rt = runtime(self.app)
    if rt.store.has_episode(batch_id, index):
        return {"index": index, "recorded": False}
    receipt = rt.store.load_receipt(batch_id)
    if not receipt or "run" not in receipt:
        return {"index": index, "error": "no receipt or run for this batch"}
    spec = spec_from_dict(receipt["spec"])
    try:
        row = observe_and_record(
            rt,
            batch_id,
            spec,
            receipt["run"],
            index,
            rt.settings.collect_block_seconds,
            final=False,
        )
    except NotYet:
        # Free the slot and queue again behind the others (bounded by the batch deadline).
        raise self.retry(countdown=0) from None
    except TransientBackendError as exc:
        raise self.retry(countdown=1, exc=exc) from exc
    return {"index": index, "status": row.status}


# -- aggregate -------------------------------------------------------------------------------
def finalize(rt: Runtime, batch_id: str, finalized_by: str) -> dict[str, Any] | None:
    """Build and publish the report once. Safe to call again, from any task."""
    store = rt.store
    if store.has_report(batch_id):
        return None
    receipt = store.load_receipt(batch_id)
    if not receipt or "run" not in receipt:
        log.error("cannot finalize %s: no receipt with a run", batch_id)
        return None
    spec = spec_from_dict(receipt["spec"])
    handle = receipt["run"]
    backend = rt.backend(handle["backend"])
    if finalized_by == "watchdog":
        # Collection tasks were lost: collect what the backend still has, mark the rest lost.
        for index in range(spec.count):
            if not store.has_episode(batch_id, index):
                observe_and_record(rt, batch_id, spec, handle, index, 0, final=True)
    batch_errors: list[str] = []
    facts: dict[str, Any] = {}
    try:
        finished = backend.finish_run(spec, handle)
        store.save_records(batch_id, finished.get("records", {}))
        facts = finished.get("facts", {})
    except BackendError as exc:
        batch_errors.append(f"could not read the run's records: {exc}")
    completed_at = facts.get("completed_at")
    report = build_report(
        spec,
        store.episode_rows(batch_id),
        origin=float(handle["origin"]),
        batch_errors=batch_errors,
        extra={
            "run": handle,
            "warnings": receipt.get("warnings", []),
            "finalized_by": finalized_by,
            "completed_at": completed_at,
            "job_complete_seconds": (completed_at - float(handle["origin"]))
            if completed_at
            else None,
            "reported_at": time.time(),
            # The guide's run identity: where it ran, and image caching we do not control.
            "context": handle.get("context") or f"local:{handle.get('node')}",
            "namespace": handle.get("namespace"),
            "cache_state": "uncontrolled",
            **{f"run_{name}": value for name, value in facts.items() if name != "completed_at"},
        },
    )
    if store.publish_report(batch_id, report) and not spec.keep_run:
        try:
            backend.delete_run(handle)
        except BackendError as exc:
            log.warning("batch %s: report published, run not deleted: %s", batch_id, exc)
    return report


def aggregate_batch(self: Task, results: list[Any], batch_id: str) -> dict[str, Any]:
    report = finalize(runtime(self.app), batch_id, "chord")
    if report is None:
        return {"batch_id": batch_id, "status": "already-reported"}
    return {"batch_id": batch_id, "status": report["status"], "episodes": len(results)}


def batch_watchdog(self: Task, batch_id: str) -> dict[str, Any]:
    rt = runtime(self.app)
    if rt.store.has_report(batch_id):
        return {"batch_id": batch_id, "status": "reported"}
    receipt = rt.store.load_receipt(batch_id)
    if receipt and "run" in receipt:
        countdown = _watchdog_countdown(
            spec_from_dict(receipt["spec"]), receipt["run"], rt.settings
        )
        if countdown > 0:
            raise self.retry(countdown=countdown)
    finalize(rt, batch_id, "watchdog")
    return {"batch_id": batch_id, "status": "finalized"}


def register(app: Celery) -> None:
    common: dict[str, Any] = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}
    app.task(name=k.TASK_SUBMIT, **common)(submit_batch)
    # Collectors and the watchdog requeue themselves until their batch's deadline, which bounds
    # them; Celery's default of 3 retries would turn a slow batch into a ChordError.
    unbounded = {**common, "max_retries": None}
    app.task(name=k.TASK_COLLECT, ignore_result=False, **unbounded)(collect_episode)
    app.task(name=k.TASK_AGGREGATE, **common)(aggregate_batch)
    app.task(name=k.TASK_WATCHDOG, **unbounded)(batch_watchdog)

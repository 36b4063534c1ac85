"""Publish a batch's report once, as soon as its episodes are in; then save the run's records."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_wire.errors import BackendError, TransientBackendError
from rollout_wire.rows import EpisodeRow
from rollout_wire.states import BatchStatus, Cleanup, FinalizedBy, Records
from rollout_worker.backends.base import Backend, FinishedRun
from rollout_worker.core.collect import RESCUE_FIRST_BLOCK_SECONDS, collect
from rollout_worker.core.groups import publish_every_group
from rollout_worker.core.state import (
    FLAG_CANCEL,
    FLAG_HALT,
    FLAG_QUOTA,
    BackendFor,
    BatchStore,
    Limits,
    Receipt,
    load_receipt,
)
from rollout_worker.report import build_report

log = logging.getLogger(__name__)

# A transient error while the run's records are read (an API blip) is retried this often, for
# up to RECORDS_RETRY_SECONDS after the first one; only then are they given up as failed. The
# run is not cleaned up meanwhile: the cleanup deletes what the records are read from.
RECORDS_RETRY_EVERY_SECONDS = 10.0
RECORDS_RETRY_SECONDS = 300.0


# -- report ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finalized:
    report: dict[str, Any]
    cleanup: Cleanup  # SCHEDULED (the caller schedules `cleanup`) or KEPT


def finalize(
    store: BatchStore,
    backend_for: BackendFor,
    batch_id: str,
    *,
    finalized_by: FinalizedBy,
    limits: Limits,
    now: Callable[[], float] = time.time,
) -> Finalized | None:
    """Publish the report once, as soon as the episodes are in (`save_records` follows).
    Returns None when the report was published before.

    An episode without a row is collected again from the backend first, whoever finalizes:
    the watchdog (its collectors may be lost) and the chord's callback too (a row can be lost
    after its collector finished: Redis restarted from an append-only file loses its last
    second). The backend holds the run until cleanup, so only an episode it can no longer
    produce is reported lost, with the backend's reason.
    """
    receipt = load_receipt(store, batch_id)
    if receipt is None or receipt.run is None:
        log.error("cannot finalize %s: no receipt with a run", batch_id)
        return None
    spec, run = receipt.spec, receipt.run
    backend = backend_for(run.backend)
    done: Finalized | None = None
    if not store.has_report(batch_id):
        rows = store.episode_rows(batch_id)
        missing = sorted(set(range(spec.count)) - {row.index for row in rows})
        for position, index in enumerate(missing):
            # The first look may wait: this process may not watch the batch's Pods yet.
            block = RESCUE_FIRST_BLOCK_SECONDS if position == 0 else 0
            collect(store, backend, receipt, index, block=block, final=True, limits=limits)
        if missing:
            log.warning(
                "batch %s: collected %d episode(s) again: %s", batch_id, len(missing), missing
            )
            rows = store.episode_rows(batch_id)
        publish_every_group(store, spec)
        done = _publish(store, backend, receipt, rows, finalized_by, now())
    return done


def _publish(
    store: BatchStore,
    backend: Backend,
    receipt: Receipt,
    rows: list[EpisodeRow],
    finalized_by: FinalizedBy,
    now: float,
) -> Finalized | None:
    spec, run = receipt.spec, receipt.run
    assert run is not None
    status: FinishedRun | None = None
    batch_errors: list[str] = []
    try:
        status = backend.run_status(spec, run)
    except BackendError as exc:
        batch_errors.append(f"could not read how the run ended: {exc}")
    cleanup = Cleanup.KEPT if spec.keep_run else Cleanup.SCHEDULED
    report = build_report(
        spec,
        rows,
        run,
        status,
        finalized_by=finalized_by,
        reported_at=now,
        warnings=receipt.warnings,
        batch_errors=batch_errors,
        counted=store.counted_groups(spec.batch_id) if spec.groups_wanted else (),
    ) | {"cleanup": cleanup, "records": Records.PENDING}
    if store.has_flag(spec.batch_id, FLAG_HALT):
        halted = (store.load_receipt(spec.batch_id) or {}).get("halted")
        report |= {"ok": False, "status": BatchStatus.HALTED, "halted": halted}
    elif store.has_flag(spec.batch_id, FLAG_QUOTA):
        pass  # stopped because it had its groups: the report's quota says how it went
    elif store.has_flag(spec.batch_id, FLAG_CANCEL):
        report |= {"ok": False, "status": BatchStatus.CANCELLED}
    if not store.publish_report(spec.batch_id, report):
        return None
    store.update_receipt(spec.batch_id, {"cleanup": cleanup})
    return Finalized(report, cleanup)


def save_records(
    store: BatchStore, backend_for: BackendFor, batch_id: str, *, now: float
) -> Records:
    """Save the run's records (job.json, pods.json, events, logs of the supervisor...) after
    the report, once: the receipt's `records` says when they are complete (or failed, and
    why). PENDING: a transient error, try again in RECORDS_RETRY_EVERY_SECONDS (and do not
    clean the run up before)."""
    receipt = load_receipt(store, batch_id)
    if receipt is None or receipt.run is None:
        return Records.FAILED  # nothing to read them from
    if receipt.records in (Records.COMPLETE, Records.FAILED):
        return receipt.records
    try:
        # May wait for the backend to settle (a Job's final status).
        finished = backend_for(receipt.run.backend).finish_run(receipt.spec, receipt.run)
    except TransientBackendError as exc:
        since = float((store.load_receipt(batch_id) or {}).get("records_retry_since") or now)
        if now - since < RECORDS_RETRY_SECONDS:
            log.warning("batch %s: records not read yet (%s); trying again", batch_id, exc)
            store.update_receipt(
                batch_id, {"records_retry_since": since, "records_error": str(exc)}
            )
            return Records.PENDING
        return _records_failed(store, batch_id, f"{exc} (still after {now - since:.0f} s)")
    except BackendError as exc:
        return _records_failed(store, batch_id, str(exc))
    store.save_records(batch_id, finished.records)
    store.update_receipt(
        batch_id,
        {
            "records": Records.COMPLETE,
            "run_verdict": finished.verdict,
            "completed_at": finished.completed_at,
        },
    )
    return Records.COMPLETE


def _records_failed(store: BatchStore, batch_id: str, why: str) -> Records:
    log.error("batch %s: records not saved: %s", batch_id, why)
    store.update_receipt(batch_id, {"records": Records.FAILED, "records_error": why})
    return Records.FAILED

"""What each Celery task decides, without Celery. `tasks.py` turns a Celery call into one call
here and the answer into a Celery action: a result, a retry (`Again`), or messages sent through
the `Scheduler` it passes in. Every decision of what to send next and which backend to use
lives here; when a task runs again is `retry.py`'s (one table for all tasks), the threads of the
batches' wakers `waker.py`'s.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from typing import Any, Protocol

from rollout_wire import constants as k
from rollout_wire.errors import TransientBackendError
from rollout_wire.states import Cleanup, FailureKind, FinalizedBy, Records
from rollout_worker.backends import backend_name, get_backend
from rollout_worker.backends.base import Backend, RunHandle
from rollout_worker.core.admit import fail, submit
from rollout_worker.core.collect import (
    claim,
    collect,
    give_up_at,
    rescue,
    tripped_by,
    watchdog_countdown,
)
from rollout_worker.core.feed import feed
from rollout_worker.core.finalize import RECORDS_RETRY_EVERY_SECONDS, finalize, save_records
from rollout_worker.core.groups import publish_group_of, quota_unenforced
from rollout_worker.core.lease import renewed
from rollout_worker.core.park import WAKER_LEASE_SECONDS, park, wake
from rollout_worker.core.pools import drain_pools, fill_pool
from rollout_worker.core.retry import Again, retried
from rollout_worker.core.runs import (
    CLEANUP_RECHECK_SECONDS,
    backend_for_run,
    cached_backend,
    cancel,
    cleanup,
    cleanup_pending,
    sweep,
    sweep_backends,
)
from rollout_worker.core.state import (
    FLAG_CHORD,
    FLAG_QUOTA,
    BatchStore,
    Limits,
    NotYet,
    Receipt,
    load_receipt,
)
from rollout_worker.core.waker import Wakers
from rollout_worker.settings import Settings

# The claim of the submit copy that sends a batch's chord: renewed every third of it while the
# copy sends; a copy finding it held looks again every half of it.
DISPATCH_LEASE_SECONDS = 9.0
# A collector whose fed episode ended looks for its slot's next episode this long (its own
# Pod's end may reach the pool's watch a moment after the batch's).
FEED_AFTER_ROW_SECONDS = 1.0
# A task whose Redis went away mid-run (a restart, a failover) waits this long for it to
# answer again, then runs again from the start (every task is idempotent). A task that
# failed instead would be acknowledged, and its batch might never finish.
REDIS_WAIT_SECONDS = 60.0
# What the receipt cache holds at most per process (a started batch's receipt never changes).
RECEIPT_CACHE_SIZE = 10_000
log = logging.getLogger(__name__)
_UNSAFE_ID = re.compile(r"[^a-z0-9-]")


class Park(Exception):
    """Park this collect task: leave its message for the batch's waker (`Worker.park`), which
    sends it again when its episode ends."""

    def __init__(self, batch_id: str, index: int, *, until_ready: bool = False) -> None:
        super().__init__(f"park {batch_id} #{index}")
        self.batch_id, self.index, self.until_ready = batch_id, index, until_ready


class Scheduler(Protocol):
    """The messages the lifecycle sends (Celery signatures in `tasks.py`). Each is idempotent:
    a deterministic task id, or a task that does nothing the second time."""

    def collect_batch(self, batch_id: str, count: int, watchdog_countdown: float) -> None:
        """The chord (one collector per episode, then the callback) and the watchdog."""

    def cleanup(self, batch_id: str) -> None: ...
    def cancel(self, batch_id: str) -> None: ...
    def fill_pool(self, batch_id: str) -> None: ...
    def feed(self, batch_id: str) -> None:
        """The feeder of a run fed from its pool (one task id per batch)."""

    def waker(self, batch_id: str, token: str) -> None:
        """A task that starts the waker of a batch's parked collectors (lease `token`) in the
        collector process that runs it."""

    def resend(self, message: str) -> None:
        """Send a parked task's message again, as it was."""

    def complete(self, message: str, result: dict[str, Any]) -> None:
        """Store a parked task's `result` as its worker would have (the chord counts it)."""


def default_batch_id(message_id: str) -> str | None:
    """A request without a batch id is named after its message, so a redelivery of the same
    message maps to the same batch."""
    return _UNSAFE_ID.sub("", message_id.lower())[:32] or None


class Worker:
    """One worker process's view of the lifecycle: its store, its backends (made on first
    use), the receipts of started batches, and the scheduler that sends its messages."""

    def __init__(self, settings: Settings, store: BatchStore, scheduler: Scheduler) -> None:
        self.settings = settings
        self.store = store
        self.scheduler = scheduler
        self.limits = Limits.from_settings(settings)
        self._backends: dict[str, Backend] = {}
        self._receipts: dict[str, Receipt] = {}
        # Late-bound, so that what each calls can be replaced on this worker (tests do).
        self.wakers = Wakers(
            look=lambda batch_id, token, fully: self.wake_once(batch_id, token, look_fully=fully),
            collect=lambda batch_id, index: self.collect(batch_id, index),
            resend=lambda message: self.scheduler.resend(message),
            complete=lambda message, result: self.scheduler.complete(message, result),
        )

    # -- which backend -----------------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        return cached_backend(self._backends, name, lambda: get_backend(name, self.settings))

    def backend_for_run(self, handle: RunHandle) -> Backend:
        return backend_for_run(handle, self.settings, self._backends)

    def started(self, batch_id: str) -> Receipt | None:
        """The receipt of a started batch (its spec and run never change after that)."""
        receipt = self._receipts.get(batch_id)
        if receipt is None:
            receipt = load_receipt(self.store, batch_id)
            if receipt is None or receipt.run is None:
                return None
            if len(self._receipts) > RECEIPT_CACHE_SIZE:
                self._receipts.clear()
            self._receipts[batch_id] = receipt
        return receipt

    # -- the tasks ---------------------------------------------------------------------------
    def submit(self, request: Any, *, message_id: str, attempt: int) -> dict[str, Any]:
        default_id = default_batch_id(message_id)
        try:
            with retried(k.TASK_SUBMIT, attempt):
                done = submit(
                    self.store,
                    self.backend,
                    request,
                    default_batch_id=default_id,
                    limits=self.limits,
                    now=time.time(),
                )
        except TransientBackendError as exc:  # its retries spent
            batch_id = request.get("batch_id") if isinstance(request, dict) else None
            receipt = load_receipt(self.store, str(batch_id or default_id))
            if receipt is None:
                raise
            done = fail(self.store, receipt.spec, [f"backend failed after retries: {exc}"])
        if done.dispatch and done.spec is not None and done.run is not None:
            # A copy redelivered while the first still sends (5000 messages can outlast the
            # visibility timeout on a loaded machine) looks again later instead of sending the
            # chord a second time. The claim is short and renewed while its holder sends, so a
            # holder killed mid-send delays its successor by one lease, not by its longest send.
            batch_id = done.spec.batch_id
            token = f"{message_id}:{uuid.uuid4().hex}"
            if not self.store.claim_dispatch(batch_id, token, DISPATCH_LEASE_SECONDS):
                # Not counted as a retry: the holder's renewals bound how long this lasts.
                raise Again(countdown=DISPATCH_LEASE_SECONDS / 2, counted=False)
            # Send, then flag: a crash in between re-sends the same task ids, which the result
            # backend and the per-index row store both absorb.
            try:
                with renewed(
                    lambda: self.store.claim_dispatch(batch_id, token, DISPATCH_LEASE_SECONDS),
                    every=DISPATCH_LEASE_SECONDS / 3,
                    at_most=2.0 * self.settings.visibility_timeout,
                ):
                    countdown = watchdog_countdown(done.spec, done.run, self.limits, time.time())
                    self.scheduler.collect_batch(batch_id, done.spec.count, countdown)
                    if done.run.fed:
                        self.scheduler.feed(batch_id)
                    self.store.set_flag(batch_id, FLAG_CHORD)
            except Exception:
                # This copy's retry (Redis away mid-send) must not wait out its own claim.
                with contextlib.suppress(Exception):
                    self.store.drop_dispatch(batch_id, token)
                raise
        return done.as_result()

    def collect(self, batch_id: str, index: int) -> dict[str, Any]:
        """Wait a bounded time for one episode; if it has not ended, `Again` (the slot is
        freed and the task queues behind the others); else validate and record its row once."""
        receipt = self.started(batch_id)
        if self.store.has_episode(batch_id, index):
            if receipt is not None:
                # A copy of a collector killed after the row: its group may be unstreamed.
                self._after_row(receipt, index)
            return {"index": index, "recorded": False}
        if receipt is None or receipt.run is None:
            return {"index": index, "error": "no receipt or run for this batch"}
        token = uuid.uuid4().hex
        if not claim(self.store, batch_id, index, token, self.limits):
            if self.store.has_episode(batch_id, index):
                self._after_row(receipt, index)
                return {"index": index, "recorded": False}
            raise Again()
        try:
            with retried(k.TASK_COLLECT):
                row = collect(
                    self.store,
                    self.backend(receipt.run.backend),
                    receipt,
                    index,
                    block=self.limits.collect_block_seconds,
                    final=False,
                    limits=self.limits,
                )
        except NotYet as exc:
            if exc.stopping:
                raise Again() from None
            raise Park(batch_id, index, until_ready=not exc.settled) from None
        finally:
            # Released before the retry is sent: the next copy may start at once.
            self.store.release_collect(batch_id, index, token)
        if receipt.run.fed:
            self._feed_freed_slot(receipt)
        if row.failure_kind == FailureKind.INFRASTRUCTURE and tripped_by(
            self.store, batch_id, index
        ):
            # This row tripped the circuit breaker: stop the rest as a cancel does (no sandbox
            # left); their collectors record them aborted, and the report says `halted`.
            self.scheduler.cancel(batch_id)
        self._after_row(receipt, index)
        return {"index": index, "status": row.status}

    def park(self, parked: Park, message: str) -> bool:
        """Leave a collect task's `message` for the batch's waker (sent if none runs). False:
        its episode moved meanwhile, run it again now."""
        batch_id = parked.batch_id
        receipt = self.started(batch_id)
        if receipt is None or receipt.run is None:
            return False
        backend = self.backend(receipt.run.backend)
        if not park(
            self.store, backend, receipt, parked.index, message, until_ready=parked.until_ready
        ):
            return False
        self._ensure_waker(batch_id, here=True)
        return True

    def _ensure_waker(self, batch_id: str, *, here: bool) -> None:
        """Start the batch's waker unless one holds its lease: in this process (a collector's),
        or through a task that starts it in a collector's (`here` False: the watchdog)."""
        token = uuid.uuid4().hex
        if self.store.claim_waker(batch_id, token, WAKER_LEASE_SECONDS):
            if here:
                self.wakers.start(batch_id, token)
            else:
                self.scheduler.waker(batch_id, token)

    def wake(self, batch_id: str, token: str) -> dict[str, Any]:
        """The `wake_batch` task: start the batch's waker in this process."""
        self.wakers.start(batch_id, token)
        return {"batch_id": batch_id, "wake": "started"}

    def wake_once(self, batch_id: str, token: str, *, look_fully: bool = False) -> dict[str, Any]:
        """One look of the batch's waker (`Again`: look again)."""
        receipt = self.started(batch_id)
        if receipt is None or receipt.run is None:
            return {"batch_id": batch_id, "wake": "no receipt or run for this batch"}
        try:
            with retried(k.TASK_WAKE):
                why = wake(
                    self.store,
                    self.backend(receipt.run.backend),
                    receipt,
                    token,
                    self.scheduler.resend,
                    finish=lambda ended, until: self.wakers.finish_parked(batch_id, ended, until),
                    limits=self.limits,
                    look_fully=look_fully,
                )
        except NotYet:
            raise Again() from None
        return {"batch_id": batch_id, "wake": why}

    def _after_row(self, receipt: Receipt, index: int) -> None:
        """Stream the episode's group if this row completed it; once the quota is met, stop
        the rest as a cancel does (collectors record it `aborted`)."""
        published = publish_group_of(self.store, receipt.spec, index)
        if published is not None and published.quota_met:  # exactly one collector sees this
            self.store.set_flag(receipt.batch_id, FLAG_QUOTA)
            self.scheduler.cancel(receipt.batch_id)

    def finalize(self, batch_id: str, finalized_by: FinalizedBy) -> dict[str, Any]:
        """Publish the report once, then (behind the batch) the pool refill; save the run's
        records, then the cleanup. Records a transient error kept from being read are tried
        again (this task, later) before the cleanup deletes what they are read from."""
        done = finalize(
            self.store, self.backend, batch_id, finalized_by=finalized_by, limits=self.limits
        )
        receipt = self.started(batch_id)
        if done is not None and receipt is not None and receipt.spec.warm_pool:
            # After the report: new sandboxes starting while the batch's episodes run would
            # take their CPU; after it, they are ready for the next round.
            self.scheduler.fill_pool(batch_id)
        if save_records(self.store, self.backend, batch_id, now=time.time()) == Records.PENDING:
            # Not counted: save_records bounds how long this lasts.
            raise Again(RECORDS_RETRY_EVERY_SECONDS, counted=False)
        if done is None:
            if cleanup_pending(self.store, batch_id):
                self.scheduler.cleanup(batch_id)
            return {"batch_id": batch_id, "status": "already-reported"}
        if done.cleanup == Cleanup.SCHEDULED:
            self.scheduler.cleanup(batch_id)
        return {"batch_id": batch_id, "status": done.report["status"]}

    def watchdog(self, batch_id: str) -> dict[str, Any]:
        """Look at a batch whose chord may never complete: finalise it once every episode has
        a row (the rescue collects ended ones) or its deadline passed; else look again."""
        if self.store.has_report(batch_id):
            receipt = load_receipt(self.store, batch_id)  # fresh: `started` caches it
            saved = (Records.COMPLETE, Records.FAILED)
            if receipt is not None and receipt.run is not None and receipt.records not in saved:
                # The callback may be saving them (waiting for the Jobs to settle): a cleanup
                # sent now would delete the Jobs under it (a CI run lost job.json so). Save
                # them here too, then send the cleanup (finalize does both, in that order).
                return self.finalize(batch_id, FinalizedBy.WATCHDOG)
            if cleanup_pending(self.store, batch_id):
                self.scheduler.cleanup(batch_id)
            return {"batch_id": batch_id, "status": "reported"}
        receipt = self.started(batch_id)
        if receipt is not None and receipt.run is not None:
            if quota_unenforced(self.store, receipt.spec):
                # The collector that met the quota died before it sent the stop.
                self.store.set_flag(batch_id, FLAG_QUOTA)
                self.scheduler.cancel(batch_id)
            parked = self.store.parked(batch_id)[0]
            if parked:
                self._ensure_waker(batch_id, here=False)  # its waker died
            recorded = self.store.count_episodes(batch_id)
            if recorded == receipt.spec.count:
                # Every row is in but no report: the chord's count missed a collector (its
                # result was lost in a Redis restart) and its callback may never come.
                return self.finalize(batch_id, FinalizedBy.WATCHDOG)
            backend = self.backend(receipt.run.backend)
            if rescue(self.store, backend, receipt, self.limits, time.time()):
                return self.finalize(batch_id, FinalizedBy.WATCHDOG)
            # Counted, not compared index by index: a parked episode that also has its row (a
            # copy redelivered after its collector died) can make this true while a collector
            # still holds another; that one then waits a 30 s step, not 10 s.
            quiet = bool(parked) and recorded + len(parked) >= receipt.spec.count
            countdown = watchdog_countdown(
                receipt.spec, receipt.run, self.limits, time.time(), quiet=quiet
            )
            if countdown > 0:
                raise Again(countdown)
        return self.finalize(batch_id, FinalizedBy.WATCHDOG)

    def feed(self, batch_id: str) -> dict[str, Any]:
        """Feed a run from its pool for one bounded look; then again, until done."""
        receipt = self.started(batch_id)
        if receipt is None or receipt.run is None:
            return {"batch_id": batch_id, "feed": "no receipt or run for this batch"}
        try:
            with retried(k.TASK_FEED):
                why = self._feed_look(receipt)
        except NotYet:
            if time.time() > give_up_at(receipt.spec, receipt.run, self.limits):
                return {"batch_id": batch_id, "feed": "past the batch's deadline"}
            raise Again() from None
        return {"batch_id": batch_id, "feed": why}

    def _feed_freed_slot(self, receipt: Receipt) -> None:
        """A fed run's episode ended: give its slot the next episode now. The feed task's own
        looks wait behind the collectors in their queue; this one does not. Best effort: the
        feed task is the backstop."""
        try:
            self._feed_look(receipt, FEED_AFTER_ROW_SECONDS)
        except (NotYet, TransientBackendError) as exc:
            log.debug("feed after a row of %s: %r", receipt.batch_id, exc)

    def _feed_look(self, receipt: Receipt, seconds: float | None = None) -> str:
        """One look of the feeder (`seconds`: its length and its wait for the lock; default:
        one collect block, no wait)."""
        assert receipt.run is not None
        return feed(
            self.store,
            self.backend(receipt.run.backend),
            receipt.batch_id,
            limits=self.limits,
            budget=self.settings.warm_pool_budget,
            idle_seconds=self.settings.warm_pool_idle_seconds,
            timeout=seconds,
            lock_wait=seconds or 0.0,
        )

    def cleanup(self, batch_id: str) -> dict[str, Any]:
        """Delete a reported run; while the backend deletes, look again later instead of
        holding a worker slot."""
        with retried(k.TASK_CLEANUP):
            state = cleanup(self.store, self.backend, batch_id)
        if state == Cleanup.DELETING:
            raise Again(CLEANUP_RECHECK_SECONDS)
        return {"batch_id": batch_id, "cleanup": state}

    def cancel(self, batch_id: str) -> dict[str, Any]:
        with retried(k.TASK_CANCEL):
            state = cancel(self.store, self.backend, batch_id)
        return {"batch_id": batch_id, "cancel": state}

    def fill_pool(self, batch_id: str) -> dict[str, Any]:
        """Refill the warm pool of a batch's shape (its `warm_pool` field). Idempotent: a pool
        that has its size creates nothing."""
        receipt = load_receipt(self.store, batch_id)
        if receipt is None:
            return {"batch_id": batch_id, "pool": None, "reason": "no receipt"}
        with retried(k.TASK_FILL_POOL):
            filled = fill_pool(
                self.store,
                self.backend(backend_name(receipt.spec)),
                receipt.spec,
                budget=self.settings.warm_pool_budget,
                idle_seconds=self.settings.warm_pool_idle_seconds,
                now=time.time(),
            )
        return {"batch_id": batch_id, **filled}

    def sweep(self, dry_run: bool = False) -> list[dict[str, str]]:
        """The backstop: delete orphaned runs, then drain the pools idle too long."""
        backends = sweep_backends(self.settings)
        swept = sweep(
            self.store,
            self.backend,
            backends,
            run_ttl=self.settings.run_ttl_seconds,
            now=time.time(),
            dry_run=dry_run,
            backend_for_run=self.backend_for_run,
        )
        for name in [] if dry_run else backends:
            swept += drain_pools(
                self.store,
                self.backend(name),
                idle_seconds=self.settings.warm_pool_idle_seconds,
                now=time.time(),
            )
        return [{"batch_id": s.batch_id, "action": s.action, "reason": s.reason} for s in swept]

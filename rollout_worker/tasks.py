"""Celery tasks: thin wiring of the lifecycle (`core`) to Redis, backends and Celery.

Every task is idempotent (brokers redeliver) and short (well under the visibility timeout):
- submit_batch: admit, write the receipt, start the run, fan out the collection chord.
- collect_episode (queue `collect`): wait a bounded time for one episode; if it is not done,
  requeue itself instead of holding a worker slot; else validate and record its row once.
- aggregate_batch (chord callback): publish the report once, then schedule the cleanup.
- batch_watchdog: if the chord never completes (lost callback, crashed collector), finalise the
  batch after its deadline, so a trainer is never left waiting forever.
- cleanup_run: delete a reported run; looks again later instead of waiting on Kubernetes.
- cancel_batch: stop a running batch's sandboxes; its collectors then finish it as cancelled.
- sweep: the backstop (periodic with `rollout worker --beat`): delete orphaned runs.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import replace
from typing import Any

from celery import Celery, Task, chord, group

from rollout_wire import constants as k
from rollout_wire.errors import TransientBackendError
from rollout_worker import core
from rollout_worker.backends import Backend, RunHandle, get_backend
from rollout_worker.settings import Settings
from rollout_worker.store import Store

SUBMIT_RETRIES = 5
CLAIM_POLL_SECONDS = 0.5
CLEANUP_RETRIES = 300  # x CLEANUP_RECHECK_SECONDS: ten minutes of a namespace terminating
_SAFE_ID = re.compile(r"[^a-z0-9-]")


class Clients:
    """Per-process clients (Redis, backends) and started receipts, made after the fork."""

    def __init__(self, settings: Settings) -> None:
        self.pid = os.getpid()
        self.settings = settings
        self.limits = core.Limits(
            settings.max_batch_episodes,
            settings.collect_grace_seconds,
            min(core.WATCHDOG_STEP_SECONDS, settings.visibility_timeout / 2),
            max(45.0, float(settings.visibility_timeout)),
            settings.pod_create_rate,
        )
        self.store = Store.from_url(settings.redis_url, settings.record_ttl)
        self._backends: dict[str, Backend] = {}
        self._receipts: dict[str, core.Receipt] = {}

    def backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = get_backend(name, self.settings)
        return self._backends[name]

    def backend_for_run(self, handle: RunHandle) -> Backend:
        """The backend of the cluster a run was created in (its recorded context)."""
        return backend_for_run(handle, self.settings, self._backends)

    def started(self, batch_id: str) -> core.Receipt | None:
        """The receipt of a started batch (its spec and run never change after that)."""
        receipt = self._receipts.get(batch_id)
        if receipt is None:
            receipt = core.load_receipt(self.store, batch_id)
            if receipt is None or receipt.run is None:
                return None
            if len(self._receipts) > 10_000:
                self._receipts.clear()
            self._receipts[batch_id] = receipt
        return receipt


def clients(app: Celery) -> Clients:
    current = getattr(app, "_rollout_clients", None)
    if current is None or current.pid != os.getpid():
        current = Clients(app.rollout_settings)
        app._rollout_clients = current
    return current


def submit_batch(self: Task, request: Any) -> dict[str, Any]:
    c = clients(self.app)
    default_id = _SAFE_ID.sub("", str(self.request.id).lower())[:32] or None
    try:
        done = core.submit(
            c.store,
            c.backend,
            request,
            default_batch_id=default_id,
            limits=c.limits,
            now=time.time(),
        )
    except TransientBackendError as exc:
        if self.request.retries < SUBMIT_RETRIES:
            raise self.retry(countdown=2**self.request.retries, exc=exc) from exc
        receipt = core.load_receipt(c.store, str(request.get("batch_id") or default_id))
        if receipt is None:
            raise
        done = core.fail(c.store, receipt.spec, [f"backend failed after retries: {exc}"])
    if done.dispatch and done.spec is not None and done.run is not None:
        # Send, then flag: a crash in between re-sends the same task ids, which the result
        # backend and the per-index row store both absorb.
        countdown = core.watchdog_countdown(done.spec, done.run, c.limits, time.time())
        _dispatch(self.app, done.spec.batch_id, done.spec.count, countdown)
        c.store.set_flag(done.spec.batch_id, "chord")
    return done.as_result()


def _dispatch(app: Celery, batch_id: str, count: int, watchdog_countdown: float) -> None:
    header = group(
        [
            app.signature(
                k.TASK_COLLECT,
                args=(batch_id, index),
                queue=k.QUEUE_COLLECT,
                task_id=k.collect_task_id(batch_id, index),
            )
            for index in range(count)
        ],
        task_id=k.group_id(batch_id),
    )
    body = app.signature(k.TASK_AGGREGATE, args=(batch_id,), queue=k.QUEUE_CONTROL)
    chord(header, body).apply_async(task_id=k.aggregate_task_id(batch_id))
    app.signature(k.TASK_WATCHDOG, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async(
        task_id=k.watchdog_task_id(batch_id), countdown=watchdog_countdown
    )


def collect_episode(self: Task, batch_id: str, index: int) -> dict[str, Any]:
    c = clients(self.app)
    if c.store.has_episode(batch_id, index):
        return {"index": index, "recorded": False}
    receipt = c.started(batch_id)
    if receipt is None or receipt.run is None:
        return {"index": index, "error": "no receipt or run for this batch"}
    block = c.settings.collect_block_seconds
    token = uuid.uuid4().hex
    if not _claim(c.store, batch_id, index, token, block, c.settings.visibility_timeout):
        if c.store.has_episode(batch_id, index):
            return {"index": index, "recorded": False}
        raise self.retry(countdown=0)
    again: Exception | None = None
    try:
        row = core.collect(
            c.store,
            c.backend(receipt.run.backend),
            receipt,
            index,
            block=block,
            final=False,
            limits=c.limits,
        )
    except (core.NotYet, TransientBackendError) as exc:
        again = exc
    finally:
        # Released before the retry is sent: the next copy may start at once.
        c.store.release_collect(batch_id, index, token)
    if isinstance(again, TransientBackendError):
        # Pause here, not with a countdown: a worker holds ETA messages beyond its prefetch
        # limit, and a pile of them outlives the visibility timeout and is delivered twice.
        time.sleep(1)
        raise self.retry(countdown=0, exc=again) from again
    if again is not None:
        # Free the slot and queue again behind the others (bounded by the batch deadline).
        raise self.retry(countdown=0) from None
    return {"index": index, "status": row.status}


def _claim(store: Store, batch_id: str, index: int, token: str, block: float, ttl: int) -> bool:
    """Be the one copy collecting episode `index`. A second copy (a message redelivered while
    the first still runs) waits up to `block` for the claim or the row instead of watching and
    reading the episode again; it must not return before the row exists either, or the chord
    would count the episode before it is recorded. The claim lasts one visibility timeout: a
    killed holder's claim has expired by the time its message is delivered again."""
    if store.claim_collect(batch_id, index, token, ttl):
        return True
    store.count_collect_copy(batch_id)
    end = time.monotonic() + block
    while time.monotonic() < end and not store.has_episode(batch_id, index):
        time.sleep(CLAIM_POLL_SECONDS)
        if store.claim_collect(batch_id, index, token, ttl):
            return True
    return False


def _finalize(self: Task, batch_id: str, finalized_by: str) -> dict[str, Any]:
    c = clients(self.app)
    done = core.finalize(c.store, c.backend, batch_id, finalized_by=finalized_by, limits=c.limits)
    if done is None:
        if core.cleanup_pending(c.store, batch_id):
            _schedule_cleanup(self.app, batch_id)
        return {"batch_id": batch_id, "status": "already-reported"}
    if done.cleanup == core.CLEANUP_SCHEDULED:
        _schedule_cleanup(self.app, batch_id)
    receipt = c.started(batch_id)
    if receipt is not None and receipt.spec.warm_pool:
        # Behind the batch: new sandboxes starting while its episodes run would take their
        # CPU; after its report, they are ready for the next round.
        self.app.signature(k.TASK_FILL_POOL, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async()
    return {"batch_id": batch_id, "status": done.report["status"]}


def _schedule_cleanup(app: Celery, batch_id: str) -> None:
    # A copy sent twice deletes nothing twice: cleanup is idempotent.
    app.signature(k.TASK_CLEANUP, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async(
        task_id=k.cleanup_task_id(batch_id)
    )


def aggregate_batch(self: Task, results: list[Any], batch_id: str) -> dict[str, Any]:
    return _finalize(self, batch_id, "chord")


def batch_watchdog(self: Task, batch_id: str) -> dict[str, Any]:
    c = clients(self.app)
    if c.store.has_report(batch_id):
        if core.cleanup_pending(c.store, batch_id):
            _schedule_cleanup(self.app, batch_id)
        return {"batch_id": batch_id, "status": "reported"}
    receipt = c.started(batch_id)
    if receipt is not None and receipt.run is not None:
        backend = c.backend(receipt.run.backend)
        if core.rescue(c.store, backend, receipt, c.limits, time.time()):
            return _finalize(self, batch_id, "watchdog")
        countdown = core.watchdog_countdown(receipt.spec, receipt.run, c.limits, time.time())
        if countdown > 0:
            raise self.retry(countdown=countdown)
    return _finalize(self, batch_id, "watchdog")


def cleanup_run(self: Task, batch_id: str) -> dict[str, Any]:
    c = clients(self.app)
    try:
        state = core.cleanup(c.store, c.backend, batch_id)
    except TransientBackendError as exc:
        raise self.retry(countdown=core.CLEANUP_RECHECK_SECONDS, exc=exc) from exc
    if state == core.CLEANUP_DELETING:
        raise self.retry(countdown=core.CLEANUP_RECHECK_SECONDS)
    return {"batch_id": batch_id, "cleanup": state}


def cancel_batch(self: Task, batch_id: str) -> dict[str, Any]:
    c = clients(self.app)
    try:
        state = core.cancel(c.store, c.backend, batch_id)
    except TransientBackendError as exc:
        raise self.retry(countdown=1, exc=exc) from exc
    return {"batch_id": batch_id, "cancel": state}


def fill_pool(self: Task, batch_id: str) -> dict[str, Any]:
    """Refill the warm pool of a batch's shape (its `warm_pool` field). Idempotent: a pool
    that has its size creates nothing."""
    c = clients(self.app)
    receipt = core.load_receipt(c.store, batch_id)
    if receipt is None:
        return {"batch_id": batch_id, "pool": None, "reason": "no receipt"}
    try:
        filled = core.fill_pool(
            c.store,
            c.backend(receipt.spec.backend),
            receipt.spec,
            budget=c.settings.warm_pool_budget,
            idle_seconds=c.settings.warm_pool_idle_seconds,
            now=time.time(),
        )
    except TransientBackendError as exc:
        # Up to SUBMIT_RETRIES x 5 s: long enough for a drained pool's namespace to go.
        raise self.retry(countdown=5, exc=exc) from exc
    return {"batch_id": batch_id, **filled}


def sweep(self: Task, dry_run: bool = False) -> list[dict[str, str]]:
    c = clients(self.app)
    swept = core.sweep(
        c.store,
        c.backend,
        sweep_backends(c.settings),
        run_ttl=c.settings.run_ttl_seconds,
        now=time.time(),
        dry_run=dry_run,
        backend_for_run=c.backend_for_run,
    )
    for name in [] if dry_run else sweep_backends(c.settings):
        swept += core.drain_pools(
            c.store,
            c.backend(name),
            idle_seconds=c.settings.warm_pool_idle_seconds,
            now=time.time(),
        )
    return [{"batch_id": s.batch_id, "action": s.action, "reason": s.reason} for s in swept]


def backend_for_run(handle: RunHandle, settings: Settings, cache: dict[str, Backend]) -> Backend:
    """A Kubernetes run is reached through the context recorded when it was created."""
    context = handle.context if handle.backend == "kubernetes" else None
    if context in (None, "", "in-cluster"):
        key, wanted = handle.backend, settings
    else:
        key, wanted = f"{handle.backend}@{context}", replace(settings, kube_context=context)
    if key not in cache:
        cache[key] = get_backend(handle.backend, wanted)
    return cache[key]


def sweep_backends(settings: Settings) -> list[str]:
    """The backends whose runs the sweeper lists: local always, Kubernetes when configured."""
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    return ["local", "kubernetes"] if settings.kubeconfig or in_cluster else ["local"]


def register(app: Celery) -> None:
    common: dict[str, Any] = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}
    app.task(name=k.TASK_SUBMIT, **common)(submit_batch)
    # Collectors and the watchdog requeue themselves until their batch's deadline, which bounds
    # them; Celery's default of 3 retries would turn a slow batch into a ChordError.
    unbounded = {**common, "max_retries": None}
    app.task(name=k.TASK_COLLECT, ignore_result=False, **unbounded)(collect_episode)
    app.task(name=k.TASK_AGGREGATE, **common)(aggregate_batch)
    app.task(name=k.TASK_WATCHDOG, **unbounded)(batch_watchdog)
    app.task(name=k.TASK_CLEANUP, **common, max_retries=CLEANUP_RETRIES)(cleanup_run)
    app.task(name=k.TASK_CANCEL, **common, max_retries=SUBMIT_RETRIES)(cancel_batch)
    app.task(name=k.TASK_SWEEP, **common)(sweep)
    app.task(name=k.TASK_FILL_POOL, **common, max_retries=SUBMIT_RETRIES)(fill_pool)

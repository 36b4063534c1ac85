"""Celery tasks: each turns a Celery call into one `core.Worker` call, and its answer into a
Celery action (a result, a retry when core says `Again`, messages sent for core). No decision
is made here; what each task does is in `core/worker.py`:
- submit_batch: admit, write the receipt, start the run, fan out the collection chord.
- collect_episode (queue `collect`): one episode's row, or requeue itself (bounded wait).
- aggregate_batch (chord callback) and batch_watchdog: publish the report once.
- feed_batch (queue `collect`): a run fed from its pool gets a waiting sandbox per freed slot.
- wake_batch (queue `collect`): starts the waker that records parked episodes as they end.
- cleanup_run, cancel_batch, fill_pool, sweep.

Every task is acknowledged late and given back when its worker dies (`register`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import kombu.exceptions
import kombu.utils.json
import redis
from celery import Celery, Task, chord, group
from celery.app.task import Context

from rollout_wire import constants as k
from rollout_wire.states import FinalizedBy
from rollout_worker import core
from rollout_worker.store import Store


class CeleryScheduler:
    """`core.Scheduler` with Celery signatures; deterministic task ids make a re-send a no-op."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def collect_batch(self, batch_id: str, count: int, watchdog_countdown: float) -> None:
        header = group(
            [
                self.app.signature(
                    k.TASK_COLLECT,
                    args=(batch_id, index),
                    queue=k.QUEUE_COLLECT,
                    task_id=k.collect_task_id(batch_id, index),
                    priority=k.PRIORITY_FIRST_COLLECT,
                )
                for index in range(count)
            ],
            task_id=k.chord_group_task_id(batch_id),
        )
        body = self.app.signature(k.TASK_AGGREGATE, args=(batch_id,), queue=k.QUEUE_CONTROL)
        chord(header, body).apply_async(task_id=k.aggregate_task_id(batch_id))
        self.app.signature(k.TASK_WATCHDOG, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async(
            task_id=k.watchdog_task_id(batch_id), countdown=watchdog_countdown
        )

    def cleanup(self, batch_id: str) -> None:
        self.app.signature(k.TASK_CLEANUP, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async(
            task_id=k.cleanup_task_id(batch_id)
        )

    def cancel(self, batch_id: str) -> None:
        self.app.signature(k.TASK_CANCEL, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async(
            task_id=k.cancel_task_id(batch_id)
        )

    def fill_pool(self, batch_id: str) -> None:
        self.app.signature(k.TASK_FILL_POOL, args=(batch_id,), queue=k.QUEUE_CONTROL).apply_async()

    def feed(self, batch_id: str) -> None:
        # On the collect queue: it waits on the pool's watch like a collector on its Pod's.
        self.app.signature(k.TASK_FEED, args=(batch_id,), queue=k.QUEUE_COLLECT).apply_async(
            task_id=k.feed_task_id(batch_id)
        )

    def waker(self, batch_id: str, token: str) -> None:
        self.app.signature(k.TASK_WAKE, args=(batch_id, token), queue=k.QUEUE_COLLECT).apply_async(
            task_id=k.wake_task_id(batch_id)
        )

    def resend(self, message: str) -> None:
        self.app.signature(kombu.utils.json.loads(message)).apply_async()

    def complete(self, message: str, result: dict[str, Any]) -> None:
        # What the worker's trace does after a task returns: store the result, then count the
        # chord part (the request's id, group, index in the group and chord callback).
        options = kombu.utils.json.loads(message)["options"]
        request = Context(
            id=options["task_id"],
            group=options.get("group_id"),
            group_index=options.get("group_index"),
            chord=options.get("chord"),
            root_id=options.get("root_id"),
            parent_id=options.get("parent_id"),
        )
        self.app.backend.mark_as_done(request.id, result, request=request)


def worker(app: Celery) -> core.Worker:
    """This process's worker (Redis clients and backends are made after the fork)."""
    current: core.Worker | None = getattr(app, "_rollout_worker", None)
    if current is None or app._rollout_worker_pid != os.getpid():
        settings = app.rollout_settings
        store = Store.from_url(settings.redis_url, settings.record_ttl)
        current = core.Worker(settings, store, CeleryScheduler(app))
        app._rollout_worker, app._rollout_worker_pid = current, os.getpid()
    return current


# Redis unreachable from inside a task (redis-py's and kombu's own words for it).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError)


def _run(task: Task, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except core.Park as parked:
        # The message as it came (its chord and group too), for the waker to send again.
        resent = task.signature_from_request(task.request, priority=k.PRIORITY_RESENT)
        message = kombu.utils.json.dumps(resent)
        if worker(task.app).park(parked, message):
            return _acknowledged_only(task, parked)
        raise task.retry(countdown=0) from None
    except core.Again as again:
        if again.pause:
            time.sleep(again.pause)
        # Celery checks its budget against the retries so far: one more keeps it unspent.
        budget = None if again.counted else task.request.retries + 1
        raise task.retry(
            countdown=again.countdown, exc=again.cause, max_retries=budget
        ) from again.cause
    except REDIS_DOWN as exc:
        # Run it again once Redis answers (the retry is a message in Redis too).
        worker(task.app).store.wait_reachable(core.REDIS_WAIT_SECONDS)
        raise task.retry(countdown=0, exc=exc) from exc


def _acknowledged_only(task: Task, parked: core.Park) -> dict[str, Any]:
    """End a parked collect as `raise Ignore()` would: its message acknowledged, no result
    stored and its chord part not counted (the resent copy gives both). Ignore costs more:
    Celery builds two tracebacks for it and logs one, about a third of what a long episode
    cost more than a short one (py-spy, bench_kubernetes 300 s episodes). The trace reads
    these two fields of the request when the task returns (`Backend.mark_as_done`)."""
    task.request.ignore_result = True
    task.request.chord = None
    return {"index": parked.index, "parked": True}


def submit_batch(self: Task, request: Any) -> dict[str, Any]:
    w = worker(self.app)
    message_id, attempt = str(self.request.id), self.request.retries
    return _run(self, lambda: w.submit(request, message_id=message_id, attempt=attempt))


def collect_episode(self: Task, batch_id: str, index: int) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).collect(batch_id, index))


def aggregate_batch(self: Task, results: list[Any], batch_id: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).finalize(batch_id, FinalizedBy.CHORD))


def batch_watchdog(self: Task, batch_id: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).watchdog(batch_id))


def cleanup_run(self: Task, batch_id: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).cleanup(batch_id))


def cancel_batch(self: Task, batch_id: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).cancel(batch_id))


def fill_pool(self: Task, batch_id: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).fill_pool(batch_id))


def feed_batch(self: Task, batch_id: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).feed(batch_id))


def wake_batch(self: Task, batch_id: str, token: str) -> dict[str, Any]:
    return _run(self, lambda: worker(self.app).wake(batch_id, token))


def sweep(self: Task, dry_run: bool = False) -> list[dict[str, str]]:
    return _run(self, lambda: worker(self.app).sweep(dry_run))


TASKS: dict[str, Callable[..., Any]] = {
    k.TASK_SUBMIT: submit_batch,
    k.TASK_COLLECT: collect_episode,
    k.TASK_AGGREGATE: aggregate_batch,
    k.TASK_WATCHDOG: batch_watchdog,
    k.TASK_CLEANUP: cleanup_run,
    k.TASK_CANCEL: cancel_batch,
    k.TASK_FILL_POOL: fill_pool,
    k.TASK_FEED: feed_batch,
    k.TASK_WAKE: wake_batch,
    k.TASK_SWEEP: sweep,
}


def register(app: Celery) -> None:
    for name, function in TASKS.items():
        app.task(
            name=name,
            bind=True,
            acks_late=True,
            reject_on_worker_lost=True,
            max_retries=core.MAX_RETRIES[name],
            # Kept: the chord's callback counts the collectors' results, clients read submit's.
            ignore_result=False,
        )(function)

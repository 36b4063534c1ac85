"""When a task runs again: its retry budget (`MAX_RETRIES`) and what a transient backend error
makes of each task (`TRANSIENT`, applied by `retried`). The whole policy is here, so a task
states which it is and no task writes its own `except TransientBackendError`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rollout_wire import constants as k
from rollout_wire.errors import TransientBackendError
from rollout_worker.core.runs import CLEANUP_RECHECK_SECONDS

# How often each task may run again (None: until its batch's deadline, which bounds it: a
# collector or watchdog requeues itself for as long as its batch runs, and Celery's default
# of 3 retries would turn a slow batch into a ChordError).
SUBMIT_RETRIES = 5
MAX_RETRIES: dict[str, int | None] = {
    k.TASK_SUBMIT: SUBMIT_RETRIES,
    k.TASK_COLLECT: None,
    # These two run again only when Redis went away under them (see REDIS_WAIT_SECONDS).
    k.TASK_AGGREGATE: 3,
    k.TASK_WATCHDOG: None,
    # x CLEANUP_RECHECK_SECONDS: ten minutes of a namespace terminating.
    k.TASK_CLEANUP: 300,
    k.TASK_CANCEL: SUBMIT_RETRIES,
    k.TASK_SWEEP: 3,
    # x FILL_RETRY_SECONDS: long enough for a drained pool's namespace to go.
    k.TASK_FILL_POOL: SUBMIT_RETRIES,
    k.TASK_FEED: None,  # like a collector: until every episode is claimed or the deadline
    k.TASK_WAKE: 3,  # it only starts a waker thread: again only when Redis went away
}
# A collector whose backend failed transiently pauses this long before it requeues: not with
# a countdown, because a worker holds ETA messages beyond its prefetch limit, and a pile of
# them outlives the visibility timeout and is delivered twice.
TRANSIENT_PAUSE_SECONDS = 1.0
CANCEL_RETRY_SECONDS = 1.0
FILL_RETRY_SECONDS = 5.0


class Again(Exception):
    """Run this task again after `countdown` seconds (after sleeping `pause` in the worker).
    `cause` is the error that made it so, if any (Celery re-raises it once retries run out).
    `counted=False`: a wait bounded otherwise, not spent from the task's retry budget."""

    def __init__(
        self,
        countdown: float = 0.0,
        *,
        pause: float = 0.0,
        cause: Exception | None = None,
        counted: bool = True,
    ) -> None:
        super().__init__(f"again in {countdown}s")
        self.countdown, self.pause, self.cause = countdown, pause, cause
        self.counted = counted


@dataclass(frozen=True)
class OnTransient:
    """How a task runs again after a transient backend error: after `countdown` seconds, or
    at once after a `pause` in the worker; `backoff`: 2**attempt seconds, for `tries` tries
    (then the error itself propagates, for the task to end the batch)."""

    countdown: float = 0.0
    pause: float = 0.0
    backoff: bool = False
    tries: int | None = None

    def again(self, exc: TransientBackendError, attempt: int) -> Again | None:
        if self.tries is not None and attempt >= self.tries:
            return None
        countdown = float(2**attempt) if self.backoff else self.countdown
        return Again(countdown, pause=self.pause, cause=exc)


TRANSIENT: dict[str, OnTransient] = {
    k.TASK_SUBMIT: OnTransient(backoff=True, tries=SUBMIT_RETRIES),
    k.TASK_COLLECT: OnTransient(pause=TRANSIENT_PAUSE_SECONDS),
    # The waker's looks (the thread `wake_batch` starts): its loop sleeps the pause.
    k.TASK_WAKE: OnTransient(pause=TRANSIENT_PAUSE_SECONDS),
    k.TASK_FEED: OnTransient(pause=TRANSIENT_PAUSE_SECONDS),
    k.TASK_CLEANUP: OnTransient(countdown=CLEANUP_RECHECK_SECONDS),
    k.TASK_CANCEL: OnTransient(countdown=CANCEL_RETRY_SECONDS),
    k.TASK_FILL_POOL: OnTransient(countdown=FILL_RETRY_SECONDS),
}


@contextmanager
def retried(task: str, attempt: int = 0) -> Iterator[None]:
    """A transient backend error inside becomes `Again` as `TRANSIENT[task]` says; once its
    tries are spent, the error itself."""
    try:
        yield
    except TransientBackendError as exc:
        again = TRANSIENT[task].again(exc, attempt)
        if again is None:
            raise
        raise again from exc

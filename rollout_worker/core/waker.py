"""The threads of a process's wakers: one per batch whose collectors it parked, looking until
none is left (`run`), and the pool that records a burst of ended episodes at once
(`finish_parked`). What each look decides is `Worker.wake_once` (and `park.wake`); this
module only runs the looks and the recordings."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

from rollout_worker.core.park import FULL_LOOK_SECONDS
from rollout_worker.core.retry import TRANSIENT_PAUSE_SECONDS, Again

# The waker records a burst of ends on this many threads of its process: each mostly waits
# on the API server (the Pod's log) and Redis, so one thread recorded about 10 a second.
FINISH_THREADS = 8
# A waker thread that failed this many looks in a row (a second apart) ends.
WAKER_MAX_ERRORS = 60
log = logging.getLogger(__name__)

# One look: (batch id, lease token, look fully) -> the look's answer (`Again`: look again).
Look = Callable[[str, str, bool], dict[str, Any]]


class Wakers:
    """Runs the looks of this process's wakers on threads of their own. `look` is one look;
    `collect` records a parked episode here (the collect task's own call); `resend` and
    `complete` hand a parked task's message back to Celery (the `Scheduler`'s)."""

    def __init__(
        self,
        look: Look,
        collect: Callable[[str, int], dict[str, Any]],
        resend: Callable[[str], None],
        complete: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.look, self.collect = look, collect
        self.resend, self.complete = resend, complete

    def start(self, batch_id: str, token: str) -> None:
        threading.Thread(
            target=self.run, args=(batch_id, token), name=f"waker-{batch_id}", daemon=True
        ).start()

    def run(self, batch_id: str, token: str) -> None:
        """Look until done. An error pauses it; a pause longer than its lease lets another
        take over (its next look then sees the lease held and ends); errors that go on end it
        (its lease lapses, and the watchdog starts another)."""
        errors = 0
        # Its first full look a while after it starts: each parked collector has just looked.
        full_look_at = time.monotonic() + FULL_LOOK_SECONDS
        while errors < WAKER_MAX_ERRORS:
            look_fully = time.monotonic() >= full_look_at
            if look_fully:
                full_look_at = time.monotonic() + FULL_LOOK_SECONDS
            try:
                done = self.look(batch_id, token, look_fully)
            except Again as again:
                errors = 0
                time.sleep(again.pause)
                continue
            except Exception:  # Redis away, or a bug
                errors += 1
                if look_fully:
                    # That full look was spent on the error: the next look is full, not one
                    # FULL_LOOK_SECONDS later (an end only it can see would wait that long).
                    full_look_at = time.monotonic()
                log.exception("waker of %s", batch_id)
                time.sleep(TRANSIENT_PAUSE_SECONDS)
                continue
            log.info("waker of %s: %s", batch_id, done["wake"])
            return
        log.error("waker of %s: %d errors in a row, leaving it to another", batch_id, errors)

    @cached_property
    def _finishers(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(FINISH_THREADS, thread_name_prefix="finish")

    def finish_parked(self, batch_id: str, ended: list[tuple[int, str]], until: float) -> None:
        """The waker's collect of parked episodes that ended (index, message), several at once;
        one not begun by `until` (monotonic) is sent again for a collector."""

        def one(item: tuple[int, str]) -> None:
            index, message = item
            if time.monotonic() < until:
                self.finish_here(batch_id, index, message)
            else:
                self.resend(message)

        for _ in self._finishers.map(one, ended):  # its errors are the waker's
            pass

    def finish_here(self, batch_id: str, index: int, message: str) -> None:
        """What a parked episode's resent task would do, here. Anything but a row (another
        copy holds the claim, a transient error) sends the message again for a collector to
        deal with, as before."""
        try:
            result = self.collect(batch_id, index)
        except Exception as exc:  # Again, Park, Redis or the backend away
            log.info("waker of %s: #%d sent again (%s)", batch_id, index, exc)
            self.resend(message)
            return
        # Not sent again if this fails: its chord part may already count (the rescue records
        # the batch either way).
        self.complete(message, result)
        log.info("waker of %s: #%d recorded here", batch_id, index)

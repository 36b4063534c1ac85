"""Parked collectors, so that collecting an episode costs the same whatever its length.

A collect task waits one block for its episode; one that has not ended by then does not
requeue itself every block, which cost a long episode one Celery round trip per block. It
leaves its own message in Redis and ends (`park`). One waker per batch waits on every parked
episode at once (`Backend.wait_ended`). The waker is a thread of the collector process that
parked first (a task would wait behind the whole collect queue), holding a lease in Redis.
When an episode ends, the waker records it itself (`Wakers.finish_parked`: the same collect,
then the task's result stored as its worker would have, so the chord counts it): a message
sent again would cost a second Celery round trip. It sends the message again (the same task)
for a burst beyond what it records in a second, and for what it cannot finish there. Where the
collector streams `ready` (Kubernetes), an episode parked before it was ready is sent again
once ready, to stream it and park again.

Nothing is lost when a worker dies:
- a collector killed before its message was parked is redelivered as before; one killed after
  leaves a copy in both places, and the second copy finds the row (every collect is
  idempotent, the chord counts a task id once);
- a waker renews its lease at every look; one that died lets it lapse, and the next collector to
  park starts another, or the watchdog sends a `wake_batch` task that starts one;
- an end the waker's watch cannot see (a Pod never created) it finds in a full look at each
  parked episode every FULL_LOOK_SECONDS, as its collector would have;
- one it took and died recording is neither parked nor claimed: the watchdog's rescue
  records it (the rescue leaves the parked and the claimed alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout_wire.errors import BackendError, TransientBackendError
from rollout_worker.backends.base import Backend
from rollout_worker.core.collect import give_up_at
from rollout_worker.core.state import FLAG_CANCEL, BatchStore, Limits, NotYet, Receipt

# The waker reads the list of parked episodes again (and renews its lease) this often while
# that list changes (collectors park meanwhile), and QUIET_RESCAN_SECONDS once it stopped: a
# long batch's waker then looks a third as often. An end it watches wakes it at once either
# way; one parked meanwhile is watched from the next look.
RESCAN_SECONDS = 1.0
QUIET_RESCAN_SECONDS = 3.0
# A waker that has not renewed its lease for this long is presumed dead: another may start.
WAKER_LEASE_SECONDS = 10.0
# The waker begins recording the ends of one look itself for this long (on a few threads:
# `Wakers.finish_parked`); the rest of a burst is sent again as messages, so that collector
# processes share one too large for a second. A count (16 per look) sent most of a
# 200-episode burst again, at about 6 ms of Celery round trip each, and delayed their rows.
FINISH_SECONDS_PER_LOOK = 1.0
# The waker looks fully at every parked episode (what its collector's look would ask) this
# often, for ends its watch cannot see: a Pod never created, an index its Job gave up on.
FULL_LOOK_SECONDS = 60.0


def park(
    store: BatchStore,
    backend: Backend,
    receipt: Receipt,
    index: int,
    message: str,
    *,
    until_ready: bool,
) -> bool:
    """Leave episode `index`'s collect message for the waker (`until_ready`: send it again
    once ready, not only once ended). False if that happened meanwhile (the message is taken
    back: run it again now)."""
    assert receipt.run is not None
    store.park(receipt.batch_id, index, message, until_ready)
    # It may have moved after its collector's last look and before the waker saw it parked.
    obs = backend.wait_episode(receipt.run, index, 0, until_ready=until_ready)
    if obs.terminal or (until_ready and obs.ready):
        return store.unpark(receipt.batch_id, index) is None
    return True


def wake(
    store: BatchStore,
    backend: Backend,
    receipt: Receipt,
    token: str,
    send: Callable[[str], None],
    *,
    finish: Callable[[list[tuple[int, str]], float], None],
    limits: Limits,
    look_fully: bool = False,
    now: Callable[[], float] = time.time,
) -> str:
    """One bounded look (one collect block) of the batch's waker, holding its lease `token`:
    `finish` (record here) parked episodes that ended, those it cannot begin within
    FINISH_SECONDS_PER_LOOK sent again; `send` the message of every other one that ends or
    becomes ready (`look_fully`: first look at each parked episode as its collector would).
    Returns why the waker is done; raises NotYet to look again."""
    assert receipt.run is not None
    batch_id, lease = receipt.batch_id, WAKER_LEASE_SECONDS
    end = time.monotonic() + limits.collect_block_seconds
    if not store.has_flag(batch_id, FLAG_CANCEL):
        # What a collector did after each block: revive what runs the episodes if it died
        # (locally, the run's supervisor); parked collectors no longer do it.
        backend.resume_run(receipt.run)
    previous: list[int] | None = None
    while True:
        look = store.waker_look(batch_id, token, lease, FLAG_CANCEL)
        if not look.held:
            return "another waker holds the lease"
        parked, until_ready = look.parked, look.until_ready
        rescan = QUIET_RESCAN_SECONDS if parked == previous else RESCAN_SECONDS
        previous = parked
        if look.reported:
            for index in parked:  # reported: their rows are in, their messages are moot
                store.unpark(batch_id, index)
            store.drop_waker(batch_id, token)
            return "reported"
        if not parked:
            store.drop_waker(batch_id, token)
            # A collector that parked after that look saw the lease held and sent no waker.
            if not store.parked(batch_id)[0] or not store.claim_waker(batch_id, token, lease):
                return "nothing parked"
            continue
        remaining = end - time.monotonic()
        finishing = True
        if look.cancelled or now() >= give_up_at(receipt.spec, receipt.run, limits):
            ended = parked  # their collectors record them aborted or lost
            finishing = False
        else:
            ended = backend.wait_ended(
                receipt.run, parked, max(0.0, min(rescan, remaining)), ready=until_ready
            )
            if look_fully:
                look_fully = False
                seen = set(ended)
                ended += [
                    i
                    for i in parked
                    if i not in seen and _moved(backend, receipt, i, until_ready=i in until_ready)
                ]
        here: list[tuple[int, str]] = []
        for index in ended:
            message = store.unpark(batch_id, index)
            if message is None:
                continue
            # An ended episode is recorded without a second Celery round trip (a publish, a
            # delivery, a task run: most of what a long episode cost more than a short one).
            # One only ready yet goes back to a collector, which streams it and parks again.
            if finishing and index not in until_ready:
                here.append((index, message))
            else:
                send(message)
        if here:
            finish(here, time.monotonic() + FINISH_SECONDS_PER_LOOK)
        if time.monotonic() >= end:
            raise NotYet


def _moved(backend: Backend, receipt: Receipt, index: int, *, until_ready: bool) -> bool:
    """What a collector's own look at a parked episode finds: ended (or ready, if waited on
    until ready). A backend error is for the collector to record, with its cause."""
    assert receipt.run is not None
    try:
        obs = backend.wait_episode(receipt.run, index, 0, until_ready=until_ready)
    except TransientBackendError:
        raise
    except BackendError:
        return True
    return obs.terminal or (until_ready and obs.ready)

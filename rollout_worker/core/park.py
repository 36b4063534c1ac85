"""Parked collectors, so that collecting an episode costs the same whatever its length.

A collect task waits one block for its episode; one that has not ended by then does not
requeue itself every block, which cost a long episode one Celery round trip per block (and
filled the collect queue with the collectors of episodes not started yet). It leaves its own
message in Redis and ends (`park`). One waker task per batch waits on every parked episode at
once (`Backend.wait_ended`) and sends each message again the moment its episode ends (`wake`):
the same task, so the chord counts it. Where the collector streams `ready` (Kubernetes), an
episode parked before it was ready is sent again once ready, to stream it and park again.

Nothing is lost when a worker dies:
- a collector killed before its message was parked is redelivered as before; one killed after
  leaves a copy in both places, and the second copy finds the row (every collect is
  idempotent, the chord counts a task id once);
- the waker requeues itself every block like a collector; one that dies stops renewing its
  lease, and the next collector to park or the watchdog's next look sends another;
- an end the waker cannot see (a Pod never created) is recorded by the watchdog's rescue.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout_worker.backends.base import Backend
from rollout_worker.core.collect import give_up_at
from rollout_worker.core.state import FLAG_CANCEL, BatchStore, Limits, NotYet, Receipt

# A waker that has not looked for this many collect blocks is presumed dead (its look is one
# block, then it waits in the collect queue): another may be sent.
WAKER_LEASE_BLOCKS = 4
# The waker reads the list of parked episodes again this often (collectors park meanwhile).
RESCAN_SECONDS = 1.0


def waker_lease(limits: Limits) -> float:
    return WAKER_LEASE_BLOCKS * limits.collect_block_seconds


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
    ready = {index} if until_ready else set()
    if backend.wait_ended(receipt.run, [index], 0, ready=ready):
        return store.unpark(receipt.batch_id, index) is None
    return True


def wake(
    store: BatchStore,
    backend: Backend,
    receipt: Receipt,
    token: str,
    send: Callable[[str], None],
    *,
    limits: Limits,
    now: Callable[[], float] = time.time,
) -> str:
    """One bounded look (one collect block) of the batch's waker, holding its lease `token`:
    `send` the message of every parked episode that ends. Returns why the waker is done;
    raises NotYet to look again."""
    assert receipt.run is not None
    batch_id, lease = receipt.batch_id, waker_lease(limits)
    if not store.claim_waker(batch_id, token, lease):
        return "another waker holds the lease"
    end = time.monotonic() + limits.collect_block_seconds
    if not store.has_flag(batch_id, FLAG_CANCEL):
        # What a collector did after each block: revive what runs the episodes if it died
        # (locally, the run's supervisor); parked collectors no longer do it.
        backend.resume_run(receipt.run)
    while True:
        parked, until_ready = store.parked(batch_id)
        if store.has_report(batch_id):
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
        if store.has_flag(batch_id, FLAG_CANCEL) or now() >= give_up_at(
            receipt.spec, receipt.run, limits
        ):
            ended = parked  # their collectors record them aborted or lost
        else:
            ended = backend.wait_ended(
                receipt.run, parked, max(0.0, min(RESCAN_SECONDS, remaining)), ready=until_ready
            )
        for index in ended:
            message = store.unpark(batch_id, index)
            if message is not None:
                send(message)
        if time.monotonic() >= end:
            store.claim_waker(batch_id, token, lease)  # renewed for the next look
            raise NotYet

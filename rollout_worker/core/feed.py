"""Feed a run from its pool: one freed slot, one claimed waiting sandbox (see
`FeedingBackend.feed_run`). One look at a time per batch (a lock in Redis). The collector that
sees its episode end looks at once (it is the first to know a slot is free); the feed task is
the backstop (the first claims, the pool's top-up, a collector that died): each of its looks is
bounded and it requeues itself, so a killed worker's feeder comes back like a collector.

What it claims is recorded in the receipt: the Pods a claim may touch (`feed_planned`) before
the claim, and the claims themselves in the run's `warm` list (the proof cleanup deletes by)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from rollout_worker.backends.base import Backend, FeedingBackend
from rollout_worker.core.state import FLAG_CANCEL, BatchStore, Limits, NotYet, load_receipt

# The feeder's lock is the collecting claim of this index: no episode has it.
FEEDER_INDEX = -1
LOCK_POLL_SECONDS = 0.05


def feed(
    store: BatchStore,
    backend: Backend,
    batch_id: str,
    *,
    limits: Limits,
    budget: int,
    idle_seconds: float,
    timeout: float | None = None,
    lock_wait: float = 0.0,
) -> str:
    """One bounded look of the feeder (`timeout`, default one collect block). Returns why it
    is done; raises NotYet to look again. `lock_wait`: how long to wait for another copy's
    look to end before giving up on this one."""
    receipt = load_receipt(store, batch_id)
    if receipt is None or receipt.run is None or not receipt.run.fed:
        return "not fed"
    if not isinstance(backend, FeedingBackend):
        return f"the {backend.name} backend feeds its own runs"
    if store.has_report(batch_id) or store.has_flag(batch_id, FLAG_CANCEL):
        return "stopped"
    token = uuid.uuid4().hex
    give_up = time.monotonic() + lock_wait
    while not store.claim_collect(batch_id, FEEDER_INDEX, token, limits.claim_seconds):
        if time.monotonic() >= give_up:
            raise NotYet  # another copy feeds: look again later, in case it dies
        time.sleep(LOCK_POLL_SECONDS)
    spec, run = receipt.spec, receipt.run

    def record(fields: Mapping[str, Any]) -> None:
        current = store.load_receipt(batch_id) or {}
        update: dict[str, Any] = {}
        if "feed_planned" in fields:
            update["feed_planned"] = dict(current.get("feed_planned") or {}) | dict(
                fields["feed_planned"]
            )
        if "warm" in fields:
            update["run"] = dict(current.get("run") or run.to_dict()) | {"warm": fields["warm"]}
            store.register_run(batch_id, {"run": update["run"]})
        store.update_receipt(batch_id, update)

    try:
        fed = backend.feed_run(
            spec,
            run,
            record,
            timeout=limits.collect_block_seconds if timeout is None else timeout,
            budget=budget,
            idle_seconds=idle_seconds,
        )
    finally:
        store.release_collect(batch_id, FEEDER_INDEX, token)
    if fed.done:
        return "every episode claimed"
    if store.has_flag(batch_id, FLAG_CANCEL):
        return "stopped"
    raise NotYet

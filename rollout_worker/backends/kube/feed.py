"""The feeder loop of a fed run (more episodes than slots, and a warm pool to take them from):
every slot is fed from the pool as it frees, instead of by a Job whose next wave starts cold
once its controller sees the last one end. What to do next is `read.feed_plan`'s (pure) on one
snapshot of the pool's watch; this loop claims, records and tops the pool up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from rollout_wire.request import BatchSpec
from rollout_worker.backends.base import Fed, ReceiptUpdate, WarmClaim
from rollout_worker.backends.kube import read
from rollout_worker.backends.kube.pools import Claimed, WarmPools
from rollout_worker.backends.kube.watch import PodWatch

# The feeder tops its pool up at most this often (each top-up lists the pool: the watch may
# not show the Pods the last one created yet).
FEED_FILL_EVERY_SECONDS = 1.0
# The pool a fed run keeps ahead of itself, in waves of its parallelism: a Pod takes longer to
# start than a short episode to run, so one wave ahead left slots idle (on the 2-core real
# node, 72 episodes at parallelism 10: 111 s with one wave ahead, 62 s with two, 61 s with
# three; benchmarks/bench_slots.py).
FEED_AHEAD_WAVES = 2


def feed(
    pools: WarmPools,
    watch: PodWatch,
    spec: BatchSpec,
    key: str,
    namespace: str,
    warm: Sequence[WarmClaim],
    record: ReceiptUpdate,
    *,
    timeout: float,
    budget: int,
    idle_seconds: float,
) -> Fed:
    """Feed the run's free slots from pool `key` (its Pods in `namespace`, seen by `watch`)
    for up to `timeout` seconds; `warm` are the run's claims so far."""
    # As the receipt holds them (`record` writes them, the plan reads them).
    claims = [claim.to_list() for claim in warm]
    end = time.monotonic() + timeout
    filled_at = -math.inf

    def plan_of(pods: dict[str, dict[str, Any]]) -> read.FeedPlan:
        return read.feed_plan(
            pods.values(),
            spec.batch_id,
            spec.parallelism,
            spec.count,
            claims,
            ahead=FEED_AHEAD_WAVES * spec.parallelism,
        )

    def actionable(pods: dict[str, dict[str, Any]]) -> bool:
        plan = plan_of(pods)
        top_up = plan.idle_have < plan.idle_wanted
        return (
            plan.done
            or bool(plan.claims or plan.found)
            or (top_up and time.monotonic() - filled_at >= FEED_FILL_EVERY_SECONDS)
        )

    while True:
        left = end - time.monotonic()
        if left <= 0:
            return Fed(_claims(claims), done=False)
        plan = plan_of(watch.wait(0, min(left, FEED_FILL_EVERY_SECONDS), actionable))
        if plan.found:
            # Claimed by a look that died before its record: recorded now, handed over
            # unless its runner already has its episode.
            claims += plan.found
            record({"warm": claims})
            for index, name, uid in plan.found:
                pools.hand_over_again(spec, namespace, Claimed(index, name, uid, 0.0))
        if plan.done:
            return Fed(_claims(claims), done=True)
        if plan.claims:
            record(
                {
                    "feed_planned": {
                        str(i): [p["metadata"]["name"], p["metadata"]["uid"]]
                        for i, p in plan.claims
                    }
                }
            )
            taken = pools.take(spec, namespace, plan.claims, time.time)
            claims += [c.claim.to_list() for c in taken]
            record({"warm": claims})
        if plan.idle_have < plan.idle_wanted and (
            time.monotonic() - filled_at >= FEED_FILL_EVERY_SECONDS
        ):
            filled_at = time.monotonic()
            # The pool ahead of the batch: its own count (a list) decides what
            # is created, so a look racing a watch that has not seen its Pods yet does
            # not create them twice.
            pools.fill(spec, key, plan.idle_wanted, budget, idle_seconds)


def _claims(claims: list[list[Any]]) -> list[WarmClaim]:
    return [WarmClaim.from_list(c) for c in claims]

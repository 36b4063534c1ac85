"""The feeder's plan (kube/read.feed_plan): pure, from one snapshot of a pool's Pods."""

from __future__ import annotations

from rollout_wire import constants as k
from rollout_worker.backends.kube.objects import POOL_STATE_CLAIMED, POOL_STATE_IDLE
from rollout_worker.backends.kube.read import DELETED_MARK, feed_plan

BATCH = "b1"


def pool_pod(
    name: str,
    created: str,
    *,
    state: str = "running",
    batch: str | None = None,
    index: int | None = None,
) -> dict:
    labels = {k.LABEL_POOL_STATE: POOL_STATE_IDLE}
    if batch is not None:
        labels = {
            k.LABEL_POOL_STATE: POOL_STATE_CLAIMED,
            k.LABEL_BATCH: batch,
            k.LABEL_EPISODE_INDEX: str(index),
        }
    phase = {"running": "Running", "terminated": "Running", "pending": "Pending"}[state]
    statuses = [] if state == "pending" else [{"name": "episode", "state": {state: {}}}]
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": labels,
            "creationTimestamp": created,
        },
        "status": {"phase": phase, "containerStatuses": statuses},
    }


def test_each_free_slot_gets_the_next_episode_and_the_oldest_waiting_pod():
    pods = [
        pool_pod("a", "2026-01-01T00:00:01Z", batch=BATCH, index=0),  # busy
        pool_pod("b", "2026-01-01T00:00:01Z", state="terminated", batch=BATCH, index=1),  # free
        pool_pod("new", "2026-01-01T00:00:09Z"),
        pool_pod("old", "2026-01-01T00:00:05Z"),
        pool_pod("starting", "2026-01-01T00:00:07Z", state="pending"),
    ]
    plan = feed_plan(pods, BATCH, parallelism=2, count=5, claims=[[0, "a", "x"], [1, "b", "y"]])
    assert [(i, p["metadata"]["name"]) for i, p in plan.claims] == [(2, "old")]
    assert not plan.found and not plan.done
    # Two episodes left after this claim: two idle Pods wanted; "new" and "starting" are idle.
    assert (plan.idle_wanted, plan.idle_have) == (2, 2)


def test_a_claim_no_look_recorded_is_found_and_never_claimed_again():
    pods = [
        pool_pod("a", "2026-01-01T00:00:01Z", state="terminated", batch=BATCH, index=0),
        pool_pod("w", "2026-01-01T00:00:02Z"),
    ]
    plan = feed_plan(pods, BATCH, parallelism=1, count=2, claims=[])
    assert plan.found == [[0, "a", "uid-a"]]
    assert [i for i, _ in plan.claims] == [1]  # episode 0 is not claimed twice


def test_other_batches_pods_are_neither_slots_nor_waiting():
    pods = [
        pool_pod("theirs", "2026-01-01T00:00:01Z", batch="other", index=0),
        pool_pod("w", "2026-01-01T00:00:02Z"),
    ]
    plan = feed_plan(pods, BATCH, parallelism=1, count=2, claims=[[0, "mine", "u"]])
    # Our episode 0 is claimed but its Pod is not in the snapshot (gone): its slot is free.
    assert [(i, p["metadata"]["name"]) for i, p in plan.claims] == [(1, "w")]
    assert plan.idle_wanted == 0 and plan.done is False


def test_deleted_pods_free_their_slot_and_are_not_waiting():
    gone = pool_pod("g", "2026-01-01T00:00:01Z", batch=BATCH, index=0) | {DELETED_MARK: True}
    dead = pool_pod("d", "2026-01-01T00:00:01Z") | {DELETED_MARK: True}
    plan = feed_plan([gone, dead], BATCH, parallelism=1, count=3, claims=[[0, "g", "uid-g"]])
    assert plan.claims == [] and plan.idle_have == 0 and plan.idle_wanted == 1


def test_done_once_every_episode_is_claimed():
    pods = [pool_pod("a", "2026-01-01T00:00:01Z", batch=BATCH, index=0)]
    plan = feed_plan(pods, BATCH, parallelism=4, count=1, claims=[[0, "a", "uid-a"]])
    assert plan.done and plan.idle_wanted == 0 and plan.claims == []


def test_the_pool_is_kept_ahead_by_the_asked_number_of_pods_within_what_is_left():
    pods = [pool_pod("a", "2026-01-01T00:00:01Z", batch=BATCH, index=0)]
    plan = feed_plan(pods, BATCH, parallelism=1, count=10, claims=[[0, "a", "u"]], ahead=2)
    assert plan.idle_wanted == 2
    plan = feed_plan(pods, BATCH, parallelism=1, count=2, claims=[[0, "a", "u"]], ahead=2)
    assert plan.idle_wanted == 1  # one episode left: one Pod is enough

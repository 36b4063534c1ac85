"""Warm sandboxes inside a sandbox host (rollout_worker/backends/host/warm.py): which batches
may start warm, how many sandboxes a host keeps waiting per batch, where they may start and
which ones go when a taken episode needs their slot."""

from __future__ import annotations

from typing import Any

from rollout_wire.request import BatchSpec, parse_spec
from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.host.warm import cold_reason, evictions, starts, wanted

POLICY = {"model": "scripted", "url": "http://127.0.0.1:9/"}


def spec(**fields: Any) -> BatchSpec:
    request = {"backend": "kubernetes", "isolation": "host", "warm_pool": 2} | fields
    return parse_spec(request, max_episodes=None)


def file_tasks(**extra: Any) -> list[dict[str, Any]]:
    (task,) = load_task_set("bundled", only=["shipping-boundary"])
    return [dict(task) | extra]


def test_a_file_task_batch_with_a_policy_may_start_warm() -> None:
    assert cold_reason(spec(tasks=file_tasks(), policy=POLICY), "bwrap") is None
    assert cold_reason(spec(count=3), "bwrap") is None  # the demo: no task, no policy


def test_batches_a_waiting_sandbox_cannot_run_start_cold() -> None:
    assert cold_reason(spec(count=3, warm_pool=0), "bwrap") == "no warm_pool"
    assert "isolation none" in str(cold_reason(spec(count=3), "none"))
    # Hidden tests: a waiting sandbox has no grader's sandbox behind it.
    hidden = file_tasks(tests={"test_x.py": "assert True\n"})
    assert "graded apart" in str(cold_reason(spec(tasks=hidden, policy=POLICY), "bwrap"))
    # Env tables: a hand-over line carries no secret.
    secret = file_tasks(env={"environment": {"TOKEN": "x"}})
    assert "has env" in str(cold_reason(spec(tasks=secret, policy=POLICY), "bwrap"))


def test_a_batch_wants_no_more_than_its_pool_its_parallelism_and_what_is_left() -> None:
    assert wanted(warm_pool=4, parallelism=8, untaken=10, waiting=0) == 4
    assert wanted(warm_pool=4, parallelism=2, untaken=10, waiting=0) == 2
    assert wanted(warm_pool=4, parallelism=8, untaken=1, waiting=0) == 1
    assert wanted(warm_pool=4, parallelism=8, untaken=10, waiting=3) == 1
    # Nothing left to take: every waiting one is too many.
    assert wanted(warm_pool=4, parallelism=8, untaken=0, waiting=3) == -3
    assert wanted(warm_pool=4, parallelism=8, untaken=-1, waiting=0) == 0


def test_waiting_sandboxes_start_only_in_slots_no_lease_and_no_other_holds() -> None:
    assert starts(4, 1, {"a": 0}, {"a": 5}) == {"a": 3}
    assert starts(4, 1, {"a": 2}, {"a": 5}) == {"a": 1}
    assert starts(4, 4, {"a": 0}, {"a": 2}) == {}
    # Shared round the batches, one at a time, none beyond what each wants.
    assert starts(6, 1, {"a": 0, "b": 0}, {"a": 3, "b": 3}) == {"a": 3, "b": 2}
    assert starts(6, 0, {"a": 0, "b": 0}, {"a": 1, "b": 4}) == {"a": 1, "b": 4}
    assert starts(6, 0, {}, {"a": 0, "b": -2}) == {}


def test_a_taken_episode_that_uses_its_own_waiting_sandbox_evicts_nothing() -> None:
    # Two slots: one lease (the new one) and one waiting sandbox of its batch, which it uses.
    assert evictions(2, 1, {"a": 1}, "a") == {}
    # Full host: two leases and one waiting of the new episode's batch, which it takes.
    assert evictions(2, 2, {"a": 1}, "a") == {}


def test_a_taken_episode_evicts_another_batchs_waiting_sandbox_from_its_slot() -> None:
    # Two slots, a waiting sandbox of "a" in the one free slot; an episode of "b" comes.
    assert evictions(2, 2, {"a": 1}, None) == {"a": 1}
    # The batch with the most waiting gives first; the new episode's own batch last.
    assert evictions(4, 2, {"a": 1, "b": 2}, None) == {"b": 1}
    assert evictions(4, 3, {"a": 2, "b": 2}, "a") == {"b": 2}
    assert evictions(3, 3, {"a": 2, "b": 1}, "a") == {"b": 1, "a": 1}
    # A retry (cold) of a batch with waiting sandboxes: its own go too when nothing else can.
    assert evictions(2, 2, {"a": 1}, None) == {"a": 1}
    assert evictions(3, 1, {"a": 2}, None) == {}

"""Groups as they finish and the quota (`core.groups`, through `core.Worker`), without Celery:
one entry per group, the first `groups_wanted` passing groups counted, the rest aborted."""

from __future__ import annotations

import json
import time

import pytest

from rollout_wire.rows import EpisodeRow
from rollout_wire.states import EpisodeStatus, FinalizedBy, GroupStatus
from rollout_worker import core
from rollout_worker.core.collect import stale_or_not
from rollout_worker.core.groups import publish_group_of
from rollout_worker.settings import Settings
from tests.unit.stubs import MemoryStore, StubBackend
from tests.unit.test_worker import Sent

TASKS = [
    {"id": f"t{n}", "statement": "fix it", "files": {"a.py": "x = 1\n"}, "test_command": ["f"]}
    for n in range(1, 4)
]
POLICY = {"url": "http://10.0.0.5:8000"}


def reward_log(index: int, at: float, reward: float) -> str:
    """An agent episode's log: ready, one step, its reward (0 is a sample, not a failure)."""
    task, sample = divmod(index, 2)
    identity = {
        "episode_id": f"ep-b1-{index}",
        "task_id": f"t{task + 1}",
        "sample": sample,
        "group_id": f"b1:t{task + 1}",
    }
    step = {"actions": [{"tool": "submit", "observation": "ok"}], "response": {"choices": []}}
    events = [
        {"event": "ready", "at": at, "mode": "agent"},
        {"event": "step", "at": at + 0.1, "step": 1, **step},
        {
            "event": "reward",
            "at": at + 0.2,
            "reward": reward,
            "reward_rule": "all",
            "baseline_exit": 1,
            "tests_exit": 0 if reward >= 1 else 1,
            "steps": 1,
            "stop_reason": "submit",
        },
    ]
    return "".join(json.dumps(e | identity) + "\n" for e in events)


@pytest.fixture
def parts():
    store, backend, sent = MemoryStore(), StubBackend(origin=time.time()), Sent()
    w = core.Worker(Settings(collect_block_seconds=0.01), store, sent)
    w._backends.update(local=backend, stub=backend)
    return w, store, backend, sent


def submit(w, **request):  # type: ignore[no-untyped-def]
    base = {"batch_id": "b1", "tasks": TASKS, "samples_per_task": 2, "policy": POLICY}
    w.submit(base | request, message_id="m1", attempt=0)


def end(backend, index, reward=1.0):  # type: ignore[no-untyped-def]
    at = backend.origin + 0.5
    backend.ended[index] = ("Succeeded", reward_log(index, at, reward))


def group_entries(store, batch="b1"):  # type: ignore[no-untyped-def]
    return [payload for b, kind, payload in store.stream if b == batch and kind == "group"]


def test_a_group_is_streamed_once_when_its_last_sample_has_its_row(parts):
    w, store, backend, _ = parts
    submit(w)
    end(backend, 0)
    w.collect("b1", 0)
    assert group_entries(store) == []  # one sample of two
    end(backend, 1, reward=0.0)
    w.collect("b1", 1)
    assert group_entries(store) == [("b1:t1", False)]
    group = store.groups["b1"]["b1:t1"]
    assert group["rewards"] == [1.0, 0.0] and group["varied"] is True
    assert group["status"] == GroupStatus.COMPLETE and group["mean"] == 0.5
    w.collect("b1", 1)  # a redelivered collector
    w.collect("b1", 0)
    assert len(group_entries(store)) == 1


def test_a_collector_killed_after_the_row_leaves_the_group_to_its_next_copy(parts):
    w, store, backend, _ = parts
    submit(w)
    end(backend, 0)
    end(backend, 1)
    w.collect("b1", 0)
    receipt = w.started("b1")
    # The first copy records the row and dies before it streams the group.
    core.collect(store, backend, receipt, 1, block=0, final=False, limits=w.limits)
    assert group_entries(store) == []
    w.collect("b1", 1)  # its message, delivered again
    assert group_entries(store) == [("b1:t1", False)]


def test_the_report_streams_a_group_nobody_streamed_before_it(parts):
    w, store, backend, _ = parts
    submit(w)
    receipt = w.started("b1")
    for index in range(6):
        end(backend, index)
        core.collect(store, backend, receipt, index, block=0, final=False, limits=w.limits)
    w.finalize("b1", FinalizedBy.WATCHDOG)
    kinds = [kind for b, kind, _ in store.stream if kind in ("group", "report")]
    assert kinds == ["group", "group", "group", "report"]


def test_the_quota_counts_the_first_groups_then_aborts_the_rest_without_a_failure(parts):
    w, store, backend, sent = parts
    submit(w, groups_wanted=2)
    for index in (0, 1, 2):
        end(backend, index)
        w.collect("b1", index)
    assert sent.cancels == []
    end(backend, 3)
    w.collect("b1", 3)  # the second group: the quota is met
    assert sent.cancels == ["b1"] and store.has_flag("b1", core.FLAG_QUOTA)
    w.cancel("b1")  # what the cancel task runs: the stub stops the rest
    for index in (4, 5):
        backend.ended[index] = ("Failed", "")
        assert w.collect("b1", index)["status"] == EpisodeStatus.ABORTED
    assert w.finalize("b1", FinalizedBy.CHORD)["status"] == "succeeded"
    report = store.reports["b1"]
    assert report["ok"] is True and report["errors"] == []
    assert report["failed_episodes"] == 0 and report["lost_episodes"] == 0
    assert report["aborted_episodes"] == 2 and report["infrastructure_failures"] == 0
    quota = report["quota"]
    assert quota["counted"] == ["b1:t1", "b1:t2"] and quota["cut"] == ["b1:t3"]
    cut = next(g for g in report["groups"] if g["group_id"] == "b1:t3")
    assert cut["status"] == GroupStatus.ABORTED and cut["rewards"] == [] and cut["failed"] == []
    assert [w_["index"] for w_ in cut["withdrawn"]] == [4, 5]
    assert group_entries(store)[-1] == ("b1:t3", False)


def test_a_varied_filter_counts_only_groups_with_distinct_rewards(parts):
    w, store, backend, sent = parts
    submit(w, groups_wanted=1, group_filter="varied")
    for index in (0, 1):  # t1: 1, 1 gives no signal
        end(backend, index)
        w.collect("b1", index)
    assert store.counted_groups("b1") == [] and sent.cancels == []
    end(backend, 2)
    end(backend, 3, reward=0.0)
    w.collect("b1", 2)
    w.collect("b1", 3)
    assert store.counted_groups("b1") == ["b1:t2"] and sent.cancels == ["b1"]


def test_a_quota_not_met_says_so(parts):
    w, store, backend, _ = parts
    submit(w, groups_wanted=3, group_filter="varied")
    for index in range(6):
        end(backend, index)
        w.collect("b1", index)
    assert w.finalize("b1", FinalizedBy.CHORD)["status"] == "quota-not-met"
    assert store.reports["b1"]["quota"]["met"] is False


def test_the_watchdog_sends_the_stop_a_dead_collector_did_not(parts):
    w, store, backend, sent = parts
    submit(w, groups_wanted=1)
    receipt = w.started("b1")
    for index in (0, 1):
        end(backend, index)
        core.collect(store, backend, receipt, index, block=0, final=False, limits=w.limits)
    publish_group_of(store, receipt.spec, 1)  # counted; the collector dies before the stop
    assert sent.cancels == []
    with pytest.raises(core.Again):
        w.watchdog("b1")
    assert sent.cancels == ["b1"] and store.has_flag("b1", core.FLAG_QUOTA)


def test_a_sample_too_many_versions_behind_its_trainer_is_stale(parts):
    w, store, _, _ = parts
    submit(w, policy=POLICY | {"max_policy_lag": 2, "trainer": "me"})
    spec = w.started("b1").spec

    def row(first: str) -> EpisodeRow:
        return EpisodeRow(0, "ep", EpisodeStatus.OK, reward=1, policy_versions={"first": first})

    store.versions["me"] = "5"
    assert stale_or_not(store, spec, row("3")).status == EpisodeStatus.OK  # lag 2: within
    stale = stale_or_not(store, spec, row("2"))
    assert stale.status == EpisodeStatus.STALE and stale.reward == 0 and stale.failure_kind is None
    assert "max_policy_lag 2" in (stale.failure_cause or "")
    store.versions["me"] = "v5"  # not an integer: never compared
    assert stale_or_not(store, spec, row("2")).status == EpisodeStatus.OK

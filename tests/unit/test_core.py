"""The batch lifecycle (`rollout_worker.core`) with an in-memory store and a stub backend."""

from __future__ import annotations

import pytest

from rollout_wire.errors import BackendError, OwnershipError, TransientBackendError
from rollout_wire.states import Cleanup
from rollout_worker import core
from rollout_worker.core.finalize import RECORDS_RETRY_SECONDS
from tests.unit.stubs import MemoryStore, StubBackend, good_log

LIMITS = core.Limits(max_batch_episodes=100, collect_grace_seconds=30)


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def backend():
    return StubBackend()


def submit(store, backend, message, default="task-1"):
    return core.submit(
        store, lambda name: backend, message, default_batch_id=default, limits=LIMITS, now=999.0
    )


def started(store, backend, **request):
    done = submit(store, backend, {"batch_id": "b1", "count": 3, **request})
    assert done.status == "started"
    return core.load_receipt(store, "b1")


def test_a_valid_request_gets_a_receipt_before_its_run_and_one_chord(store, backend):
    done = submit(store, backend, {"batch_id": "b1", "count": 3})
    assert (done.status, done.dispatch, backend.created) == ("started", True, 1)
    receipt = store.receipts["b1"]
    assert receipt["namespace"] == "ns-b1" and receipt["run"]["origin"] == 1000.0
    store.set_flag("b1", "chord")
    again = submit(store, backend, {"batch_id": "b1", "count": 3, "submitted_at": 5.0})
    # A redelivery adopts the run and keeps the first delivery's request; no second chord.
    assert (again.status, again.dispatch) == ("started", False)
    assert again.spec is not None and again.spec.submitted_at == 999.0


@pytest.mark.parametrize(
    "message",
    [
        None,
        [1, 2],
        "count=3",
        7,
        {"count": "3"},
        {"count": 3, "evil": True},
        {"count": 10**6},
        {"count": 3, "batch_id": "NOT AN ID"},
    ],
)
def test_malformed_messages_are_rejected_before_anything_is_created(store, backend, message):
    done = submit(store, backend, message)
    assert done.status == "rejected" and done.errors
    assert backend.created == 0 and store.receipts == {}
    # The sender still gets an answer, under the id the message would have had.
    assert store.reports["task-1"]["status"] == "rejected"


def test_a_bad_copy_never_answers_for_the_batch_that_owns_its_id(store, backend):
    started(store, backend)
    done = submit(store, backend, {"batch_id": "b1", "count": -1})
    assert done.status == "rejected" and "b1" not in store.reports
    other = submit(store, backend, {"batch_id": "b1", "count": 4})
    assert other.status == "conflict" and backend.created == 1 and "b1" not in store.reports


def test_a_run_that_cannot_start_is_reported_as_an_error(store, backend):
    backend.fail_start = BackendError("RuntimeClass 'cube' does not exist")
    done = submit(store, backend, {"batch_id": "b1", "count": 2})
    assert done.status == "error" and not done.dispatch
    assert store.reports["b1"]["errors"] == ["RuntimeClass 'cube' does not exist"]


def collect(store, backend, receipt, index, now, final=False):
    return core.collect(
        store, backend, receipt, index, block=0, final=final, limits=LIMITS, now=lambda: now
    )


def test_collect_waits_then_validates_and_counts_each_episode_once(store, backend):
    receipt = started(store, backend)
    with pytest.raises(core.NotYet):
        collect(store, backend, receipt, 0, now=1001.0)
    assert ("b1", "state", (0, "running")) in store.stream
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", 1000.5))
    assert collect(store, backend, receipt, 0, now=1002.0).status == "ok"
    backend.ended[0] = ("Failed", "")  # a later copy sees something else: it must not count
    collect(store, backend, receipt, 0, now=1003.0)
    assert store.rows["b1"][0].status == "ok"
    assert [e for e in store.stream if e[1] == "episode"] == [("b1", "episode", 0)]


def test_collect_streams_ready_from_the_sandbox_and_rewarded_from_the_row(store, backend):
    receipt = started(store, backend)
    with pytest.raises(core.NotYet):
        collect(store, backend, receipt, 1, now=1001.0)
    assert store.states["b1"][1] == "running"
    backend.ready.add(1)
    with pytest.raises(core.NotYet):
        collect(store, backend, receipt, 1, now=1001.5)
    assert store.states["b1"][1] == "ready"
    backend.ended[1] = ("Succeeded", good_log("ep-b1-1", 1000.5))
    collect(store, backend, receipt, 1, now=1002.0)
    states = [e[2] for e in store.stream if e[1] == "state" and e[2][0] == 1]
    assert states == [(1, "running"), (1, "ready"), (1, "rewarded")]
    # An episode that ended without a reward event never shows as rewarded.
    backend.ended[2] = ("Failed", "")
    collect(store, backend, receipt, 2, now=1002.0)
    assert (2, "rewarded") not in [e[2] for e in store.stream if e[1] == "state"]


def test_an_episode_still_running_after_the_deadline_and_grace_is_lost(store, backend):
    receipt = started(store, backend, deadline_seconds=60)
    give_up = core.give_up_at(receipt.spec, receipt.run, LIMITS)
    assert give_up == 1000.0 + 60 + 30
    with pytest.raises(core.NotYet):
        collect(store, backend, receipt, 1, now=give_up - 1)
    row = collect(store, backend, receipt, 1, now=give_up + 1)
    assert row.status == "lost" and row.reward == 0 and "deadline" in row.errors[0]


def test_a_failed_episode_never_carries_a_reward(store, backend):
    receipt = started(store, backend)
    zero = good_log("ep-b1-2", 1000.5).replace('"reward": 1', '"reward": 0')
    backend.ended[2] = ("Succeeded", zero)
    row = collect(store, backend, receipt, 2, now=1002.0)
    assert row.status == "failed" and row.reward == 0


def finalize(store, backend, by="chord"):
    return core.finalize(store, lambda name: backend, "b1", finalized_by=by, limits=LIMITS)


def test_the_report_is_published_once_and_schedules_the_cleanup(store, backend):
    receipt = started(store, backend)
    for index in range(3):
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", 1000.5))
        collect(store, backend, receipt, index, now=1002.0)
    done = finalize(store, backend)
    assert done is not None and done.cleanup == Cleanup.SCHEDULED
    report = store.reports["b1"]
    assert report["ok"] and report["reward_sum"] == 3 and report["cleanup"] == "scheduled"
    assert report["job_complete_seconds"] == 3.0 and report["records"] == "pending"
    # Published first; the records follow, and the receipt says so.
    assert "b1" not in store.records
    assert core.save_records(store, lambda name: backend, "b1", now=1003.0) == "complete"
    assert store.records["b1"] == {"run.json": "{}"}
    assert store.receipts["b1"]["records"] == "complete"
    assert finalize(store, backend) is None  # a second callback publishes nothing


def test_records_a_transient_error_kept_from_being_read_are_tried_again_then_given_up(
    store, backend
):
    """An API blip while the records are read leaves them pending (the caller tries again and
    holds the cleanup back); one that lasts RECORDS_RETRY_SECONDS, or an error that is not
    transient, ends them failed with the error, never silently."""
    started(store, backend)
    finalize(store, backend)

    def save(now):
        return core.save_records(store, lambda name: backend, "b1", now=now)

    backend.fail_finish = [BackendError("job gone")]
    assert save(1003.0) == "failed" and store.receipts["b1"]["records_error"] == "job gone"
    assert save(1004.0) == "failed" and "b1" not in store.records  # not read again

    store.receipts["b1"].pop("records")  # as if it had not tried
    backend.fail_finish = [TransientBackendError("API server said 503")] * 2
    assert save(1010.0) == "pending"
    assert store.receipts["b1"]["records_error"] == "API server said 503"
    assert "records" not in store.receipts["b1"] and "b1" not in store.records
    assert save(1010.0 + RECORDS_RETRY_SECONDS - 1) == "pending"
    assert save(1010.0 + RECORDS_RETRY_SECONDS) == "complete"  # it answers again in time
    assert store.records["b1"] == {"run.json": "{}"}

    store.receipts["b1"].pop("records")
    backend.fail_finish = [TransientBackendError("API server said 503")]
    assert save(1010.0 + RECORDS_RETRY_SECONDS) == "failed"  # a blip that lasted too long
    assert "still after 300 s" in store.receipts["b1"]["records_error"]


def test_a_row_lost_after_its_collector_finished_is_collected_again_not_reported_lost(
    store, backend
):
    receipt = started(store, backend)
    for index in range(3):
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", 1000.5))
        collect(store, backend, receipt, index, now=1002.0)
    del store.rows["b1"][1]  # Redis restarted from its files without its last second
    done = finalize(store, backend)  # the chord's callback: every collector has finished
    assert done is not None
    report = done.report
    assert (report["successful_episodes"], report["lost_episodes"]) == (3, 0), report["errors"]
    assert sorted(store.rows["b1"]) == [0, 1, 2]


def test_an_episode_the_backend_can_no_longer_produce_is_lost_with_its_reason(store, backend):
    receipt = started(store, backend)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", 1000.5))
    collect(store, backend, receipt, 0, now=1002.0)

    def gone(*args, **kwargs):
        raise BackendError("run folder /tmp/x is gone")

    backend.wait_episode = gone
    done = finalize(store, backend)
    assert done is not None and done.report["lost_episodes"] == 2
    assert store.rows["b1"][1].failure_cause == "run folder /tmp/x is gone"


def test_the_watchdog_collects_what_ended_and_reports_the_rest_lost(store, backend):
    receipt = started(store, backend)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", 1000.5))
    done = finalize(store, backend, by="watchdog")
    assert done is not None
    report = done.report
    assert (report["successful_episodes"], report["lost_episodes"]) == (1, 2)
    assert report["finalized_by"] == "watchdog" and report["ok"] is False
    assert core.watchdog_countdown(receipt.spec, receipt.run, LIMITS, now=0) == 10
    assert core.watchdog_countdown(receipt.spec, receipt.run, LIMITS, now=10**10) == 0


def test_a_kept_run_is_not_cleaned_up(store, backend):
    started(store, backend, keep_run=True)
    done = finalize(store, backend, by="watchdog")
    assert done is not None and done.cleanup == Cleanup.KEPT
    assert core.cleanup(store, lambda name: backend, "b1") == "kept" and backend.deleted == 0


def test_cleanup_looks_again_until_the_run_is_gone_and_then_is_a_no_op(store, backend):
    started(store, backend)
    finalize(store, backend, by="watchdog")
    backend.deleting_for = 2
    states = [core.cleanup(store, lambda name: backend, "b1") for _ in range(4)]
    assert states == ["deleting", "deleting", "deleted", "deleted"]
    assert backend.deleted == 3 and store.receipts["b1"]["cleanup"] == "deleted"


def test_cleanup_that_cannot_prove_ownership_is_recorded_not_retried(store, backend):
    started(store, backend)
    finalize(store, backend, by="watchdog")

    def refuse(handle):
        raise OwnershipError("namespace has another uid")

    backend.delete_run = refuse
    assert core.cleanup(store, lambda name: backend, "b1") == "failed"
    assert "another uid" in store.receipts["b1"]["cleanup_error"]


def test_a_cancelled_batch_stops_its_run_and_reports_what_had_finished(store, backend):
    receipt = started(store, backend)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", 1000.5))
    collect(store, backend, receipt, 0, now=1001.0)
    assert core.cancel(store, lambda name: backend, "b1") == "cancelling"
    assert backend.cancelled == 1
    # Collectors of unfinished episodes finish at once, without waiting for the deadline.
    rows = [collect(store, backend, receipt, i, now=1002.0) for i in (1, 2)]
    assert [r.status for r in rows] == ["lost", "lost"] and "cancelled" in rows[0].errors[0]
    done = finalize(store, backend)
    assert done is not None and done.report["status"] == "cancelled"
    assert done.report["successful_episodes"] == 1 and done.report["ok"] is False
    assert core.cancel(store, lambda name: backend, "b1") == "already-reported"
    assert core.cancel(store, lambda name: backend, "nope") == "unknown"


def sweep(store, backend, now, dry_run=False):
    return {
        s.batch_id: s.action
        for s in core.sweep(
            store, lambda name: backend, ["stub"], run_ttl=3600, now=now, dry_run=dry_run
        )
    }


def test_the_sweeper_deletes_only_runs_it_can_prove_and_nothing_live(store, backend):
    started(store, backend)  # b1: running
    assert sweep(store, backend, now=1010.0) == {}
    # Its receipt expires (lost Redis data, or a long-kept run): the registry still proves it.
    del store.receipts["b1"]
    assert sweep(store, backend, now=1010.0, dry_run=True) == {"b1": "would-delete"}
    assert backend.deleted == 0
    assert sweep(store, backend, now=1010.0) == {"b1": "deleted"} and "b1" not in store.registry
    # A run with our labels that the registry never heard of is listed, never touched.
    backend.seen.append("stranger")
    assert sweep(store, backend, now=1010.0) == {"stranger": "left"} and backend.deleted == 1


def test_the_sweeper_takes_over_stalled_cleanups_and_expired_kept_runs(store, backend):
    started(store, backend)
    finalize(store, backend, by="watchdog")  # cleanup scheduled, but its task was lost
    reported = store.reports["b1"]["reported_at"]
    assert sweep(store, backend, now=reported + 60) == {}
    assert sweep(store, backend, now=reported + core.SWEEP_STALLED_CLEANUP_SECONDS + 1) == {
        "b1": "deleted"
    }
    kept = MemoryStore()
    started(kept, backend, keep_run=True)
    finalize(kept, backend, by="watchdog")
    assert sweep(kept, backend, now=999.0 + 3000) == {}
    assert sweep(kept, backend, now=999.0 + 3601) == {"b1": "deleted"}


def test_the_rescue_leaves_parked_and_claimed_episodes_to_whoever_is_on_them(store, backend):
    """Looking at them kept a watch of every Pod of a long batch in each control process; their
    waker or collector records them, and the rescue takes only episodes nobody is on."""
    receipt = started(store, backend)
    for index in range(3):
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", 1000.5))
    store.park("b1", 0, "message 0", False)
    store.claims[("b1", 1)] = "a live collector"
    assert not core.rescue(store, backend, receipt, LIMITS, now=1000.0 + 61)
    assert set(backend.observed) == {2} and store.has_episode("b1", 2)
    assert not store.has_episode("b1", 0) and not store.has_episode("b1", 1)
    # Its collector died: the claim lapsed, and the rescue takes the episode.
    del store.claims[("b1", 1)]
    assert not core.rescue(store, backend, receipt, LIMITS, now=1000.0 + 61)
    assert store.has_episode("b1", 1)


def test_a_redelivered_callback_finds_the_cleanup_it_must_schedule_again(store, backend):
    started(store, backend)
    finalize(store, backend, by="watchdog")
    # Killed after publishing, before recording or sending the cleanup: still pending.
    store.receipts["b1"].pop("cleanup")
    assert finalize(store, backend) is None and core.cleanup_pending(store, "b1")
    core.cleanup(store, lambda name: backend, "b1")
    assert not core.cleanup_pending(store, "b1")


def test_the_watchdog_rescues_a_batch_whose_collect_task_was_lost(store, backend):
    receipt = started(store, backend)
    for index in range(3):
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", 1000.5))
    collect(store, backend, receipt, 0, now=1002.0)
    collect(store, backend, receipt, 2, now=1002.0)
    # Episode 1 ended but its collect task vanished with a killed worker: too early to tell...
    assert not core.rescue(store, backend, receipt, LIMITS, now=1010.0)
    assert not store.has_episode("b1", 1)
    # ...later the watchdog records it itself and the batch can be reported.
    assert core.rescue(store, backend, receipt, LIMITS, now=1000.0 + 61)
    assert store.rows["b1"][1].status == "ok"
    backend.ended.pop(2)
    store.rows["b1"].pop(2)  # an episode still running: not yet
    assert not core.rescue(store, backend, receipt, LIMITS, now=1000.0 + 61)
    # One that ended a moment ago is left to its own collector (a rescue racing it would read
    # its log a second time); once it has been over for a while, it is rescued.
    backend.ended[2] = ("Succeeded", good_log("ep-b1-2", 1000.5))
    backend.finished_at[2] = 1000.0 + 60
    assert not core.rescue(store, backend, receipt, LIMITS, now=1000.0 + 61)
    assert not store.has_episode("b1", 2)
    assert core.rescue(store, backend, receipt, LIMITS, now=1000.0 + 60 + core.RESCUE_ENDED_SECONDS)
    assert store.rows["b1"][2].status == "ok"

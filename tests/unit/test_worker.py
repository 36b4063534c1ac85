"""What each Celery task decides (`core.Worker`), without Celery: retries, what is sent next."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from rollout_wire import constants as k
from rollout_wire.errors import TransientBackendError
from rollout_wire.states import FinalizedBy
from rollout_worker import core
from rollout_worker.backends.base import Fed as FedLook
from rollout_worker.backends.base import KubeRunHandle, WarmClaim
from rollout_worker.core import retry as retry_module
from rollout_worker.core import worker as worker_module
from rollout_worker.core.finalize import RECORDS_RETRY_EVERY_SECONDS
from rollout_worker.settings import Settings
from tests.unit.stubs import MemoryStore, StubBackend, good_log


@dataclass
class Sent:
    """A scheduler that records what core asked to send."""

    chords: list[tuple[str, int, float]] = field(default_factory=list)
    cleanups: list[str] = field(default_factory=list)
    fills: list[str] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    feeds: list[str] = field(default_factory=list)
    wakers: list[tuple[str, str]] = field(default_factory=list)
    resent: list[str] = field(default_factory=list)
    completed: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def feed(self, batch_id: str) -> None:
        self.feeds.append(batch_id)

    def waker(self, batch_id: str, token: str) -> None:
        self.wakers.append((batch_id, token))

    def resend(self, message: str) -> None:
        self.resent.append(message)

    def complete(self, message: str, result: dict[str, Any]) -> None:
        self.completed.append((message, result))

    def collect_batch(self, batch_id: str, count: int, watchdog_countdown: float) -> None:
        self.chords.append((batch_id, count, watchdog_countdown))

    def cleanup(self, batch_id: str) -> None:
        self.cleanups.append(batch_id)

    def fill_pool(self, batch_id: str) -> None:
        self.fills.append(batch_id)

    def cancel(self, batch_id: str) -> None:
        self.cancels.append(batch_id)


class Flaky(StubBackend):
    def start_run(self, spec, record):  # type: ignore[no-untyped-def]
        raise TransientBackendError("API server said 503")


@pytest.fixture
def parts():
    # A run that starts now: the worker decides against the real clock.
    store, backend, sent = MemoryStore(), StubBackend(origin=time.time()), Sent()
    w = core.Worker(Settings(collect_block_seconds=0.01), store, sent)
    # The stub stands in for the backend the request names (and its runs name).
    w._backends.update(local=backend, stub=backend)
    return w, store, backend, sent


def test_a_submit_sends_the_chord_once_and_flags_it(parts):
    w, store, _, sent = parts
    request = {"batch_id": "b1", "count": 2}
    assert w.submit(request, message_id="m1", attempt=0)["status"] == "started"
    assert w.submit(request, message_id="m1", attempt=0)["status"] == "started"  # redelivered
    assert [(b, n) for b, n, _ in sent.chords] == [("b1", 2)]
    assert store.has_flag("b1", core.FLAG_CHORD)


def test_a_copy_redelivered_while_the_first_sends_the_chord_looks_again_later(parts):
    """Under load a 5000-episode dispatch outlived the visibility timeout, and the redelivered
    copy of the submit sent the whole chord again (the benchmark's run 2: 112 collect copies)."""
    w, store, _, sent = parts
    request = {"batch_id": "b1", "count": 2}
    assert store.claim_dispatch("b1", "the first copy, still sending", 40)
    with pytest.raises(core.Again) as again:
        w.submit(request, message_id="m1", attempt=0)
    assert 0 < again.value.countdown < w.settings.visibility_timeout
    assert not again.value.counted  # a long send must not use up the copy's retry budget
    assert sent.chords == []
    store.set_flag("b1", core.FLAG_CHORD)  # the first copy finished its send
    assert w.submit(request, message_id="m1", attempt=1)["status"] == "started"
    assert sent.chords == []


def test_a_copy_whose_send_failed_lets_its_retry_send_at_once(parts, monkeypatch):
    """Redis gone mid-send: the retry of the same copy must not wait out its own claim."""
    w, _, _, sent = parts
    request = {"batch_id": "b1", "count": 2}

    def broken(*args: object) -> None:
        raise ConnectionError("redis went away")

    monkeypatch.setattr(sent, "collect_batch", broken)
    with pytest.raises(ConnectionError):
        w.submit(request, message_id="m1", attempt=0)
    monkeypatch.undo()
    assert w.submit(request, message_id="m1", attempt=1)["status"] == "started"
    assert [(b, n) for b, n, _ in sent.chords] == [("b1", 2)]


def test_a_submit_copy_keeps_its_claim_renewed_while_it_sends(parts, monkeypatch):
    """The claim is short (a copy killed mid-send holds its batch that long at most), so a send
    longer than it must renew it, or a redelivered copy would send the chord again."""
    w, store, _, sent = parts
    monkeypatch.setattr(worker_module, "DISPATCH_LEASE_SECONDS", 0.03)
    renewals: list[str] = []
    claim = store.claim_dispatch

    def counting(batch_id: str, token: str, ttl: float) -> bool:
        renewals.append(token)
        return claim(batch_id, token, ttl)

    monkeypatch.setattr(store, "claim_dispatch", counting)
    send = sent.collect_batch

    def slow_send(*args: Any) -> None:
        deadline = time.monotonic() + 5
        while len(renewals) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        send(*args)

    monkeypatch.setattr(sent, "collect_batch", slow_send)
    w.submit({"batch_id": "b1", "count": 2}, message_id="m1", attempt=0)
    assert len(renewals) >= 4 and len(set(renewals)) == 1  # the first claim, then renewals
    assert [(b, n) for b, n, _ in sent.chords] == [("b1", 2)]


def test_a_request_without_an_id_is_named_after_its_message():
    assert worker_module.default_batch_id("3F2A-b9_c!") == "3f2a-b9c"


def test_a_transient_start_failure_backs_off_then_ends_the_batch_with_a_report(parts):
    w, store, _, sent = parts
    w._backends["local"] = Flaky()
    request = {"batch_id": "b1", "count": 2}
    for attempt, countdown in enumerate([1, 2, 4, 8, 16]):
        with pytest.raises(core.Again) as again:
            w.submit(request, message_id="m1", attempt=attempt)
        assert again.value.countdown == countdown
        assert isinstance(again.value.cause, TransientBackendError)
    result = w.submit(request, message_id="m1", attempt=core.MAX_RETRIES[k.TASK_SUBMIT])
    assert result["status"] == "error" and "after retries" in result["errors"][0]
    assert store.reports["b1"]["status"] == "error" and sent.chords == []


def test_a_collector_parks_while_its_episode_runs_and_records_it_once_it_ended(parts):
    w, store, backend, _ = parts
    w.submit({"batch_id": "b1", "count": 2}, message_id="m1", attempt=0)
    with pytest.raises(core.Park):
        w.collect("b1", 0)
    assert store.claims == {}  # released before it parks, so the resent copy starts at once
    assert backend.resumed == 1  # not ended after a wait: what runs it is revived if it died
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 0.5))
    assert w.collect("b1", 0)["status"] == "ok"
    assert w.collect("b1", 0) == {"index": 0, "recorded": False}  # a late copy


def test_a_transient_backend_error_pauses_the_collector_before_it_requeues(parts, monkeypatch):
    w, _, backend, _ = parts
    w.submit({"batch_id": "b1", "count": 1}, message_id="m1", attempt=0)

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise TransientBackendError("watch expired")

    monkeypatch.setattr(backend, "wait_episode", broken)
    with pytest.raises(core.Again) as again:
        w.collect("b1", 0)
    assert again.value.pause == retry_module.TRANSIENT_PAUSE_SECONDS
    assert isinstance(again.value.cause, TransientBackendError)


def test_a_second_copy_stands_aside_while_the_first_holds_the_claim(parts):
    w, store, _, _ = parts
    w.submit({"batch_id": "b1", "count": 1}, message_id="m1", attempt=0)
    store.claims[("b1", 0)] = "another copy"
    with pytest.raises(core.Again):
        w.collect("b1", 0)
    assert store.copies == {"b1": 1} and "b1" not in store.rows


def test_the_report_schedules_the_cleanup_and_the_pool_refill_behind_it(parts):
    w, _, backend, sent = parts
    w.submit({"batch_id": "b1", "count": 1, "warm_pool": 2}, message_id="m1", attempt=0)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 0.5))
    w.collect("b1", 0)
    assert w.finalize("b1", FinalizedBy.CHORD)["status"] == "succeeded"
    assert (sent.cleanups, sent.fills) == (["b1"], ["b1"])
    # A redelivered callback publishes nothing again but re-sends the pending cleanup.
    assert w.finalize("b1", FinalizedBy.CHORD)["status"] == "already-reported"
    assert sent.cleanups == ["b1", "b1"] and sent.fills == ["b1"]


def test_the_watchdog_looks_again_before_the_deadline_and_finalises_after_it(parts):
    w, store, _, _ = parts
    w.submit({"batch_id": "b1", "count": 1}, message_id="m1", attempt=0)
    with pytest.raises(core.Again) as again:
        w.watchdog("b1")
    assert 0 < again.value.countdown <= w.limits.watchdog_step_seconds
    assert "b1" not in store.reports
    w.limits = replace(w.limits, collect_grace_seconds=-1e6)  # its deadline long past
    assert w.watchdog("b1")["status"] == "failed"
    report = store.reports["b1"]
    assert (report["finalized_by"], report["lost_episodes"]) == ("watchdog", 1)


def test_the_watchdog_looks_less_often_while_every_episode_left_is_parked(parts):
    """Parked episodes are the waker's: the watchdog steps longer only once no episode without
    a row is left with a collector (one a collector holds may be lost with it)."""
    w, store, _, _ = parts
    w.submit({"batch_id": "b1", "count": 2}, message_id="m1", attempt=0)
    w.limits = replace(w.limits, watchdog_step_seconds=10.0, watchdog_quiet_step_seconds=30.0)
    store.park("b1", 0, "message 0", False)
    with pytest.raises(core.Again) as again:
        w.watchdog("b1")
    assert 0 < again.value.countdown <= 10.0
    store.park("b1", 1, "message 1", False)
    with pytest.raises(core.Again) as again:
        w.watchdog("b1")
    assert 10.0 < again.value.countdown <= 30.0


def test_a_watchdog_finding_the_report_out_saves_the_records_before_the_cleanup(parts):
    """A watchdog that finds the report out while its records are not saved yet (the callback
    waits for the Jobs to settle) must not send the cleanup then: it would delete the Jobs
    under the callback. It saves the records itself, then sends it."""
    w, store, backend, sent = parts
    w.submit({"batch_id": "b1", "count": 1}, message_id="m1", attempt=0)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 0.5))
    w.collect("b1", 0)
    w.finalize("b1", FinalizedBy.CHORD)
    # Where the callback stands while it waits: report out, records pending, no cleanup sent.
    store.records.pop("b1")
    store.update_receipt("b1", {"records": "pending"})
    sent.cleanups.clear()
    w.watchdog("b1")
    assert store.records["b1"] == {"run.json": "{}"}
    assert store.receipts["b1"]["records"] == "complete"
    assert sent.cleanups == ["b1"]
    # Records saved: a later watchdog only sends the pending cleanup again.
    assert w.watchdog("b1")["status"] == "reported" and sent.cleanups == ["b1", "b1"]


def test_records_kept_from_being_read_by_an_api_blip_are_tried_again_before_the_cleanup(
    parts,
):
    """The report goes out at once, but the cleanup waits until the records are saved: it
    would delete what they are read from (before, a blip marked them failed, and the cleanup
    that followed lost job.json and the events for good)."""
    w, store, backend, sent = parts
    w.submit({"batch_id": "b1", "count": 1, "warm_pool": 2}, message_id="m1", attempt=0)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 0.5))
    w.collect("b1", 0)
    backend.fail_finish = [TransientBackendError("API server said 503")] * 2
    for _ in range(2):
        with pytest.raises(core.Again) as again:
            w.finalize("b1", FinalizedBy.CHORD)
        assert again.value.countdown == RECORDS_RETRY_EVERY_SECONDS and not again.value.counted
        assert store.reports["b1"]["status"] == "succeeded" and sent.cleanups == []
        assert store.receipts["b1"].get("records") is None
    assert sent.fills == ["b1"]  # behind the report, once
    assert w.finalize("b1", FinalizedBy.CHORD)["status"] == "already-reported"
    assert store.receipts["b1"]["records"] == "complete" and store.records["b1"]
    assert sent.cleanups == ["b1"]


def test_every_task_has_a_retry_budget_and_only_the_deadline_bounds_collectors():
    assert set(core.MAX_RETRIES) == set(k.TASKS)
    assert core.MAX_RETRIES[k.TASK_COLLECT] is None and core.MAX_RETRIES[k.TASK_WATCHDOG] is None


INFRA_LOG = '{"event": "error", "kind": "infrastructure", "cause": "policy endpoint refused"}\n'


def test_the_breaker_trips_after_n_infrastructure_failures_in_a_row_and_stops_the_rest(parts):
    w, store, backend, sent = parts
    request = {"batch_id": "b1", "count": 8, "max_consecutive_infra_failures": 3}
    w.submit(request, message_id="m1", attempt=0)
    backend.ended[0] = ("Failed", INFRA_LOG)
    backend.ended[1] = ("Succeeded", good_log("ep-b1-1", backend.origin + 0.5))  # ends the run
    for index in (2, 3, 4, 5):
        backend.ended[index] = ("Failed", INFRA_LOG)
    for index in range(4):  # 0, then an ok that ends the streak, then 2 and 3
        assert w.collect("b1", index)["status"] == ("ok" if index == 1 else "failed")
        assert not store.has_flag("b1", core.FLAG_HALT) and sent.cancels == []
    w.collect("b1", 4)  # 2, 3, 4: three in a row
    assert store.has_flag("b1", core.FLAG_HALT) and sent.cancels == ["b1"]
    halted = store.receipts["b1"]["halted"]
    assert [f["index"] for f in halted["failures"]] == [2, 3, 4]
    assert "3 infrastructure failures in a row" in halted["cause"]
    w.collect("b1", 5)  # a fourth in a row: the stop is already under way, not sent again
    assert sent.cancels == ["b1"]


def test_a_halted_batch_reports_halted_with_what_tripped_it_and_the_rest_aborted(parts):
    w, store, backend, _ = parts
    request = {"batch_id": "b1", "count": 4, "max_consecutive_infra_failures": 2}
    w.submit(request, message_id="m1", attempt=0)
    for index in (0, 1):
        backend.ended[index] = ("Failed", INFRA_LOG)
        w.collect("b1", index)
    w.cancel("b1")  # what the scheduler's cancel task runs
    for index in (2, 3):
        backend.ended[index] = ("Failed", "")  # stopped by the cancel
        w.collect("b1", index)
    report = w.finalize("b1", FinalizedBy.CHORD)
    assert report["status"] == "halted"
    published = store.reports["b1"]
    assert published["ok"] is False and len(published["halted"]["failures"]) == 2
    aborted = [row for row in published["pods"] if row["index"] in (2, 3)]
    assert all(row["status"] == "lost" and "halted" in row["errors"][0] for row in aborted)
    assert published["reward_sum"] == 0 and published["successful_episodes"] == 0


def test_without_a_breaker_infrastructure_failures_never_halt_a_batch(parts):
    w, store, backend, sent = parts
    w.submit(
        {"batch_id": "b1", "count": 3, "max_consecutive_infra_failures": 0},
        message_id="m1",
        attempt=0,
    )
    for index in range(3):
        backend.ended[index] = ("Failed", INFRA_LOG)
        w.collect("b1", index)
    assert not store.has_flag("b1", core.FLAG_HALT) and sent.cancels == []


def test_the_watchdog_reports_at_once_when_every_row_is_in_but_the_chord_never_fired(parts):
    w, store, backend, _ = parts
    w.submit({"batch_id": "b1", "count": 2}, message_id="m1", attempt=0)
    for index in range(2):
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", backend.origin + 0.5))
        w.collect("b1", index)
    # Long before the rescue may start (the run began just now): no need to wait for it.
    assert w.watchdog("b1")["status"] == "succeeded"
    assert store.reports["b1"]["finalized_by"] == "watchdog"


class Fed(StubBackend):
    """A run fed from a pool: the start claims episode 0, each look of the feeder one more.
    Its handles are Kubernetes ones (only those can be fed), read back as such."""

    def start_run(self, spec, record):  # type: ignore[no-untyped-def]
        shared = vars(super().start_run(spec, record)) | {"backend": "kubernetes"}
        claim = WarmClaim(0, "pod-0", "uid-0")
        return KubeRunHandle(**shared, warm=(claim,), fed=True, pool_namespace="pool")

    def feed_run(self, spec, handle, record, *, timeout, budget, idle_seconds):  # type: ignore[no-untyped-def]
        index = len(handle.warm)
        record({"feed_planned": {str(index): [f"pod-{index}", f"uid-{index}"]}})
        claims = [*handle.warm, WarmClaim(index, f"pod-{index}", f"uid-{index}")]
        record({"warm": [claim.to_list() for claim in claims]})
        return FedLook(claims, done=len(claims) == spec.count)


def fed_backend(w: Any) -> Fed:
    backend = w._backends["local"] = w._backends["stub"] = Fed(origin=time.time())
    w._backends["kubernetes"] = backend
    return backend


def test_a_fed_run_gets_a_feeder_that_records_each_claim_until_every_episode_has_one(parts):
    w, store, _, sent = parts
    fed_backend(w)
    w.submit({"batch_id": "b1", "count": 3, "parallelism": 1}, message_id="m1", attempt=0)
    assert sent.feeds == ["b1"]
    with pytest.raises(core.Again):
        w.feed("b1")  # claims episode 1: not done
    receipt = store.load_receipt("b1")
    assert receipt["run"]["warm"] == [[0, "pod-0", "uid-0"], [1, "pod-1", "uid-1"]]
    assert store.registered_runs()["b1"]["run"]["warm"] == receipt["run"]["warm"]
    assert w.feed("b1")["feed"] == "every episode claimed"
    receipt = store.load_receipt("b1")
    assert [i for i, _, _ in receipt["run"]["warm"]] == [0, 1, 2]
    # Every Pod a claim touched was named before its claim, none lost by the merge.
    assert sorted(receipt["feed_planned"]) == ["1", "2"]


def test_one_feeder_at_a_time_and_none_after_a_cancel(parts):
    w, store, _, _ = parts
    fed_backend(w)
    w.submit({"batch_id": "b1", "count": 3, "parallelism": 1}, message_id="m1", attempt=0)
    store.claim_collect("b1", core.FEEDER_INDEX, "another copy", 60)
    with pytest.raises(core.Again):
        w.feed("b1")
    assert len(store.load_receipt("b1")["run"]["warm"]) == 1  # it claimed nothing
    store.release_collect("b1", core.FEEDER_INDEX, "another copy")
    store.set_flag("b1", core.FLAG_CANCEL)
    assert w.feed("b1")["feed"] == "stopped"


def test_the_collector_of_a_fed_episode_gives_its_slot_the_next_episode(parts):
    w, store, _, _ = parts
    backend = fed_backend(w)
    w.submit({"batch_id": "b1", "count": 3, "parallelism": 1}, message_id="m1", attempt=0)
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 1))
    w.collect("b1", 0)
    # Its row is in, and episode 1 was claimed by the same call (not by the feed task).
    assert store.has_episode("b1", 0)
    assert [i for i, _, _ in store.load_receipt("b1")["run"]["warm"]] == [0, 1]


def test_a_backend_asked_for_by_many_threads_at_once_is_made_once(monkeypatch):
    """A collector's 64 threads ask for the backend together at a batch's first collects; each
    backend made twice kept watches of its own."""
    made: list[object] = []

    def slow_make(name: str, settings: Settings) -> object:
        time.sleep(0.05)  # long enough for every thread to find none made yet
        made.append(object())
        return made[-1]

    monkeypatch.setattr(worker_module, "get_backend", slow_make)
    w = core.Worker(Settings(), MemoryStore(), Sent())
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda: got.append(w.backend("kubernetes"))) for _ in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and got == made * 16

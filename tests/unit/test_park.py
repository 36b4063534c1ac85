"""Parked collectors (`core/park.py`): a collector whose episode is still running leaves its
message for the batch's waker, which sends it again once the episode ends."""

from __future__ import annotations

import contextlib
import threading
import time
import types
from dataclasses import replace

import pytest

from rollout_wire.errors import TransientBackendError
from rollout_worker import core
from rollout_worker.core import park as park_module
from rollout_worker.core import waker as waker_module
from rollout_worker.observation import EpisodeObservation
from rollout_worker.settings import Settings
from tests.unit.stubs import MemoryStore, StubBackend, good_log
from tests.unit.test_worker import Sent


@pytest.fixture
def parts():
    store, backend, sent = MemoryStore(), StubBackend(origin=time.time()), Sent()
    w = core.Worker(Settings(collect_block_seconds=0.01), store, sent)
    w._backends.update(local=backend, stub=backend)
    # The waker's thread is not started here: each test runs its looks (`wake_once`) itself.
    w.wakers.start = lambda batch_id, token: sent.wakers.append((batch_id, token))
    w.submit({"batch_id": "b1", "count": 3}, message_id="m1", attempt=0)
    return w, store, backend, sent


def test_a_collector_not_yet_ready_parks_until_ready_then_until_its_episode_ends(parts):
    w, store, backend, sent = parts
    with pytest.raises(core.Park) as parked:  # its ready is still to be streamed
        w.collect("b1", 0)
    assert (parked.value.batch_id, parked.value.index, parked.value.until_ready) == ("b1", 0, True)
    assert w.park(parked.value, "message 0")
    ((_, token),) = sent.wakers
    with pytest.raises(core.Again):
        w.wake_once("b1", token)
    assert sent.resent == []  # neither ready nor ended
    backend.ready.add(0)
    assert w.wake_once("b1", token)["wake"] == "nothing parked"
    assert sent.resent == ["message 0"]  # ready: its collector streams it, then parks again
    with pytest.raises(core.Park) as parked:
        w.collect("b1", 0)
    assert parked.value.until_ready is False
    assert store.states["b1"][0] == "ready"


def test_on_a_backend_that_streams_progress_a_running_collector_parks_at_once(parts):
    w, _, backend, _ = parts
    backend.streams_progress = True
    with pytest.raises(core.Park):
        w.collect("b1", 1)


def test_the_first_parked_collector_sends_the_one_waker(parts):
    w, store, _, sent = parts
    assert w.park(core.Park("b1", 0), "message 0") and w.park(core.Park("b1", 1), "message 1")
    assert store.parked("b1") == ([0, 1], set())
    assert [batch for batch, _ in sent.wakers] == ["b1"]  # one lease, one waker
    assert sent.resent == []


def test_a_collector_whose_episode_ended_while_it_parked_runs_again_at_once(parts):
    w, store, backend, sent = parts
    backend.ended[2] = ("Succeeded", good_log("ep-b1-2", backend.origin + 0.5))
    assert w.park(core.Park("b1", 2), "message 2") is False
    assert store.parked("b1")[0] == [] and sent.wakers == []


def test_the_waker_records_each_ended_episode_once_and_looks_again_while_any_is_parked(parts):
    w, store, backend, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    w.park(core.Park("b1", 1), "message 1")
    ((_, token),) = sent.wakers
    backend.ended[1] = ("Succeeded", good_log("ep-b1-1", backend.origin + 0.5))
    with pytest.raises(core.Again):  # 0 still runs: it looks again after its block
        w.wake_once("b1", token)
    # Recorded here, its task's result stored for the chord: no message sent again.
    assert store.has_episode("b1", 1) and store.parked("b1")[0] == [0]
    assert sent.completed == [("message 1", {"index": 1, "status": "ok"})]
    backend.ended[0] = ("Failed", "")
    assert w.wake_once("b1", token)["wake"] == "nothing parked"
    assert [m for m, _ in sent.completed] == ["message 1", "message 0"]
    assert sent.resent == [] and store.has_episode("b1", 0)
    assert store.wakers == {}  # the next collector to park sends a new waker


def test_a_burst_the_waker_cannot_begin_recording_in_its_time_goes_back_to_collectors(
    parts, monkeypatch
):
    w, _, backend, sent = parts
    monkeypatch.setattr(park_module, "FINISH_SECONDS_PER_LOOK", 0.05)
    monkeypatch.setattr(waker_module, "FINISH_THREADS", 1)
    finish_here = w.wakers.finish_here

    def slow_finish(batch_id: str, index: int, message: str) -> None:
        finish_here(batch_id, index, message)
        time.sleep(0.06)  # the first outlasts the look's time to begin recording

    monkeypatch.setattr(w.wakers, "finish_here", slow_finish)
    for index in (0, 1):
        w.park(core.Park("b1", index), f"message {index}")
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", backend.origin + 0.5))
    ((_, token),) = sent.wakers
    with contextlib.suppress(core.Again):  # the look outlasts its (tiny) block
        w.wake_once("b1", token)
    assert len(sent.completed) == 1 and len(sent.resent) == 1
    assert {sent.completed[0][0], sent.resent[0]} == {"message 0", "message 1"}


def test_the_waker_records_a_burst_on_several_threads_at_once(parts, monkeypatch):
    w, store, backend, sent = parts
    at_once, running, lock = [], [0], threading.Lock()
    finish_here = w.wakers.finish_here

    def counted(batch_id: str, index: int, message: str) -> None:
        with lock:
            running[0] += 1
            at_once.append(running[0])
        time.sleep(0.05)
        finish_here(batch_id, index, message)
        with lock:
            running[0] -= 1

    monkeypatch.setattr(w.wakers, "finish_here", counted)
    for index in (0, 1, 2):
        w.park(core.Park("b1", index), f"message {index}")
        backend.ended[index] = ("Succeeded", good_log(f"ep-b1-{index}", backend.origin + 0.5))
    ((_, token),) = sent.wakers
    with contextlib.suppress(core.Again):
        w.wake_once("b1", token)
    assert max(at_once) > 1  # not one after another
    assert sorted(m for m, _ in sent.completed) == ["message 0", "message 1", "message 2"]
    assert sent.resent == [] and all(store.has_episode("b1", i) for i in (0, 1, 2))


def test_an_ended_episode_the_waker_cannot_record_goes_back_to_a_collector(parts):
    w, store, backend, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    ((_, token),) = sent.wakers
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 0.5))
    store.claims[("b1", 0)] = "a copy redelivered meanwhile"  # holds the collecting claim
    with contextlib.suppress(core.Again):  # the look may outlast its (tiny) block
        w.wake_once("b1", token)
    assert sent.resent == ["message 0"] and sent.completed == []
    assert not store.has_episode("b1", 0)


def test_an_end_the_waker_s_watch_misses_is_found_by_its_full_look(parts):
    """A Pod never created: only a look as its collector's would ask (the Job) sees the end.
    The watchdog's rescue leaves parked episodes alone, so the waker must find it."""
    w, store, backend, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    ((_, token),) = sent.wakers
    backend.ended[0] = ("Failed", "")
    backend.unseen.add(0)
    with contextlib.suppress(core.Again):
        w.wake_once("b1", token)
    assert store.parked("b1")[0] == [0]  # its watch alone does not see it
    assert w.wake_once("b1", token, look_fully=True)["wake"] == "nothing parked"
    assert [m for m, _ in sent.completed] == ["message 0"] and store.has_episode("b1", 0)


def test_the_waker_thread_looks_fully_once_a_while(parts, monkeypatch):
    w = parts[0]
    monkeypatch.setattr(waker_module, "FULL_LOOK_SECONDS", 0.0)
    fully: list[bool] = []

    def look(batch_id: str, token: str, *, look_fully: bool = False) -> dict[str, str]:
        fully.append(look_fully)
        if len(fully) < 3:
            raise core.Again()
        return {"wake": "nothing parked"}

    monkeypatch.setattr(w, "wake_once", look)
    w.wakers.run("b1", "t1")
    assert fully == [True, True, True]
    monkeypatch.setattr(waker_module, "FULL_LOOK_SECONDS", 3600.0)
    fully.clear()
    w.wakers.run("b1", "t1")
    assert fully == [False, False, False]


def test_a_full_look_that_fails_is_taken_again_at_the_next_look(parts, monkeypatch):
    w = parts[0]
    fully: list[bool] = []

    def look(batch_id: str, token: str, *, look_fully: bool = False) -> dict[str, str]:
        fully.append(look_fully)
        if len(fully) == 1:
            raise TransientBackendError("the API server is away")
        return {"wake": "nothing parked"}

    monkeypatch.setattr(w, "wake_once", look)
    # The clock reads 0 at the start, then 10 s on ever after: the first look is the full one
    # due then; it fails, and the next look is full too, though the next one was due at 20 s.
    monkeypatch.setattr(waker_module, "FULL_LOOK_SECONDS", 10.0)
    ticks = iter([0.0])
    clock = types.SimpleNamespace(monotonic=lambda: next(ticks, 10.0), sleep=lambda _s: None)
    monkeypatch.setattr(waker_module, "time", clock)
    w.wakers.run("b1", "t1")
    assert fully == [True, True]


def test_a_second_waker_stands_aside_while_the_first_holds_the_lease(parts):
    w, store, _, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    assert w.wake_once("b1", "another token")["wake"] == "another waker holds the lease"
    assert store.parked("b1")[0] == [0] and sent.resent == []


def test_a_collector_that_sees_a_cancel_under_way_requeues_instead_of_parking(parts):
    w, store, _, _ = parts
    store.set_flag("b1", core.FLAG_CANCEL)
    with pytest.raises(core.Again):
        w.collect("b1", 0)
    assert store.parked("b1")[0] == []


def test_the_waker_revives_what_runs_the_episodes_while_collectors_are_parked(parts):
    w, _, backend, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    ((_, token),) = sent.wakers
    resumed = backend.resumed
    with pytest.raises(core.Again):
        w.wake_once("b1", token)
    assert backend.resumed == resumed + 1


def test_a_cancel_or_the_deadline_wakes_every_parked_collector(parts):
    w, store, _, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    w.park(core.Park("b1", 1), "message 1")
    ((_, token),) = sent.wakers
    store.set_flag("b1", core.FLAG_CANCEL)
    assert w.wake_once("b1", token)["wake"] == "nothing parked"
    assert sorted(sent.resent) == ["message 0", "message 1"]


def test_the_watchdog_sends_a_task_that_starts_a_new_waker_when_the_last_one_died(parts):
    w, store, _, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    store.wakers.clear()  # its lease expired: the waker died
    with pytest.raises(core.Again):
        w.watchdog("b1")
    sent_by_watchdog = sent.wakers[-1]
    assert len(sent.wakers) == 2 and store.wakers["b1"] == sent_by_watchdog[1]
    # The task starts the waker in the collector process that runs it, with that lease.
    started: list[tuple[str, str]] = []
    w.wakers.start = lambda batch_id, token: started.append((batch_id, token))
    assert w.wake(*sent_by_watchdog)["wake"] == "started" and started == [sent_by_watchdog]


def test_parked_messages_of_a_reported_batch_are_dropped(parts):
    w, store, _, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    ((_, token),) = sent.wakers
    store.reports["b1"] = {"status": "failed"}
    assert w.wake_once("b1", token)["wake"] == "reported"
    assert store.parked("b1")[0] == [] and sent.resent == []


def test_the_waker_looks_less_often_once_nothing_new_is_parked(parts, monkeypatch):
    """Every look renews the lease and reads what is parked: while collectors park it looks
    again after a second; once the parked list holds still, after QUIET_RESCAN_SECONDS."""
    w, store, backend, sent = parts
    w.limits = replace(w.limits, collect_block_seconds=3600.0)
    w.park(core.Park("b1", 0), "message 0")
    ((_, token),) = sent.wakers
    waits: list[float] = []

    def wait_ended(handle, indexes, timeout, *, ready):
        waits.append(timeout)
        if len(waits) == 1:
            w.park(core.Park("b1", 1), "message 1")  # a collector parks during the first wait
        if len(waits) == 4:
            store.reports["b1"] = {"status": "succeeded"}
        return []

    monkeypatch.setattr(backend, "wait_ended", wait_ended)
    assert w.wake_once("b1", token)["wake"] == "reported"
    quiet, rescan = park_module.QUIET_RESCAN_SECONDS, park_module.RESCAN_SECONDS
    assert waits == [rescan, rescan, quiet, quiet]


def test_the_waker_thread_looks_until_nothing_is_parked(parts):
    w, _, backend, sent = parts
    w.park(core.Park("b1", 0), "message 0")
    ((_, token),) = sent.wakers
    backend.ended[0] = ("Succeeded", good_log("ep-b1-0", backend.origin + 0.5))
    w.wakers.run("b1", token)  # what the thread runs: returns once done
    assert [m for m, _ in sent.completed] == ["message 0"]


def test_a_collector_of_an_episode_not_started_waits_its_block_then_parks_until_ready(
    parts, monkeypatch
):
    w, _, backend, _ = parts
    w.limits = replace(w.limits, collect_block_seconds=30)
    waits: list[float] = []

    def pending(handle, index, timeout, *, until_ready=False):  # type: ignore[no-untyped-def]
        waits.append(timeout)
        return EpisodeObservation(index, handle.episode_id(index), "Pending")

    monkeypatch.setattr(backend, "wait_episode", pending)
    with pytest.raises(core.Park) as parked:
        w.collect("b1", 0)
    # One look of a whole block (parking at once doubled the task runs of a 5000 batch).
    assert parked.value.until_ready and waits == [30]


def test_a_waker_thread_whose_looks_keep_failing_ends_and_leaves_the_lease_to_lapse(
    parts, monkeypatch
):
    w, _, _, _ = parts
    looks: list[str] = []

    def broken(batch_id: str, token: str, **_: bool) -> dict:
        looks.append(token)
        raise ConnectionError("Redis away")

    monkeypatch.setattr(w, "wake_once", broken)
    monkeypatch.setattr(waker_module, "TRANSIENT_PAUSE_SECONDS", 0)
    w.wakers.run("b1", "token")  # returns: the thread ends instead of spinning forever
    assert len(looks) == waker_module.WAKER_MAX_ERRORS

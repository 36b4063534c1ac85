"""The shared Pod watch, against a scripted watch stream (no API server)."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes.client.rest import ApiException

from rollout_worker.backends.kube import watch
from rollout_worker.backends.kube.read import DELETED_MARK

INDEX = "batch.kubernetes.io/job-completion-index"


def pod(uid: str, index: int, phase: str) -> dict:
    meta = {"uid": uid, "resourceVersion": "5", "labels": {INDEX: str(index)}}
    return {"metadata": meta, "status": {"phase": phase}}


class ScriptedWatch:
    script: list[tuple[str, dict]] = []

    def stream(self, *args, **kwargs):
        time.sleep(0.1)
        for kind, obj in self.script:
            yield {"type": kind, "raw_object": obj}
        time.sleep(2)

    def stop(self):
        pass


def test_waiters_wake_on_their_episode_and_a_deleted_pod_keeps_its_last_state(monkeypatch):
    ScriptedWatch.script = [
        ("MODIFIED", pod("a", 0, "Running")),
        ("MODIFIED", pod("b", 1, "Succeeded")),
        ("DELETED", pod("a", 0, "Running")),
    ]
    monkeypatch.setattr(watch, "RawWatch", ScriptedWatch)
    listing = {"items": [], "metadata": {"resourceVersion": "1"}}
    w = watch.PodWatch(
        "ns", lambda: listing, (None, (), {}), lambda p: int(p["metadata"]["labels"][INDEX])
    )
    try:
        started = time.monotonic()
        done = w.wait(
            1, 5, lambda pods: any(p["status"]["phase"] == "Succeeded" for p in pods.values())
        )
        assert time.monotonic() - started < 2 and list(done) == ["b"]
        gone = w.wait(0, 5, lambda pods: any(p.get(DELETED_MARK) for p in pods.values()))
        assert gone["a"][DELETED_MARK] is True
        assert w.lists == 1  # one list per batch, then the watch
    finally:
        w.stop()


def test_raw_watch_events_stay_dicts_and_never_become_client_models(monkeypatch):
    raw = watch.RawWatch()

    def refuse(*_args, **_kwargs):
        raise AssertionError("deserialised into client models")

    monkeypatch.setattr(raw._api_client, "deserialize", refuse)
    pod = {"metadata": {"name": "p", "uid": "u", "resourceVersion": "7"}}
    line = json.dumps({"type": "MODIFIED", "object": pod})
    assert raw.get_return_type(lambda: None) is None
    event = raw.unmarshal_event(line, raw.get_return_type(lambda: None))
    assert event == {"type": "MODIFIED", "object": pod, "raw_object": pod}
    assert raw.unmarshal_event("  ", None) is None


class ExpiredResponse:
    """What the API server streams to a watch from a resourceVersion it no longer has."""

    status = 200

    def stream(self, amt=None, decode_content=False):
        gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
        yield json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n"

    def close(self):
        pass

    def release_conn(self):
        pass


def test_an_expired_version_comes_out_of_a_raw_watch_as_a_410_api_exception():
    # PodWatch and the KWOK harness both list again on ApiException(410). The client's own
    # Watch with deserialize=False failed here with a KeyError ('raw_object') instead.
    def list_pods(watch=False, **_kwargs):
        return ExpiredResponse()

    with pytest.raises(ApiException) as caught:
        list(watch.RawWatch().stream(list_pods, resource_version="1", timeout_seconds=5))
    assert caught.value.status == 410


def scripted_watch(monkeypatch, events: list, listed: list) -> watch.PodWatch:
    """A watch that lists `listed`, then streams `events`."""
    ScriptedWatch.script = events
    monkeypatch.setattr(watch, "RawWatch", ScriptedWatch)
    listing = {"items": listed, "metadata": {"resourceVersion": "1"}}
    return watch.PodWatch(
        "ns", lambda: listing, (None, (), {}), lambda p: int(p["metadata"]["labels"][INDEX])
    )


def counting_ended(checked: list[int]):
    """`done` for wait_any: the episode succeeded; each index it looks at goes to `checked`."""

    def ended(index: int, pods: dict) -> bool:
        checked.append(index)
        return any(p["status"]["phase"] == "Succeeded" for p in pods.values())

    return ended


def test_a_waiter_on_many_episodes_checks_each_event_for_its_own_episode_only(monkeypatch):
    events = [
        ("MODIFIED", pod("a", 0, "Running")),
        ("MODIFIED", pod("c", 2, "Succeeded")),
        ("MODIFIED", pod("b", 1, "Succeeded")),
    ]
    w = scripted_watch(monkeypatch, events, [pod("z", 3, "Succeeded")])
    checked: list[int] = []
    ended = counting_ended(checked)

    try:
        # The first look checks every episode waited on: 3 ended before the watch started.
        assert w.wait_any([0, 1, 3], 5, ended) == [3]
        checked.clear()
        started = time.monotonic()
        assert w.wait_any([0, 1], 5, ended) == [1]
        assert time.monotonic() - started < 2  # woken by the event, not the timeout
        # One full look (0 and 1), then one check per event of a waited episode (0, then 1):
        # never every waited episode at every event, and never 2, which nobody waits on.
        assert len(checked) <= 4 and 2 not in checked
        assert w.wait_any([0], 0.2, ended) == []
    finally:
        w.stop()


def test_a_repeated_caller_has_only_new_episodes_and_new_events_checked(monkeypatch):
    running = [pod(f"r{i}", i, "Running") for i in range(1, 6)]
    w = scripted_watch(monkeypatch, [("MODIFIED", pod("a", 0, "Succeeded"))], running)
    checked: list[int] = []
    ended = counting_ended(checked)

    try:
        assert w.wait_any([1, 2, 3], 0.05, ended, caller="waker") == []
        assert sorted(checked) == [1, 2, 3]  # the first call checks every episode
        checked.clear()
        # Again, with 4 and 0 new: only they are checked (1-3 had no event since).
        assert w.wait_any([0, 1, 2, 3, 4], 5, ended, caller="waker") == [0]
        assert sorted(set(checked)) == [0, 4]
        checked.clear()
        # Another caller (or none) has its own look: everything it waits on.
        assert w.wait_any([1, 2], 0.05, ended) == [] and sorted(checked) == [1, 2]
    finally:
        w.stop()


class GoneOnceWatch:
    """The first watch request finds its resourceVersion expired (410); later ones stream
    nothing. Whatever happened in between is seen only through the next listing."""

    calls = 0

    def stream(self, *args, **kwargs):
        GoneOnceWatch.calls += 1
        if GoneOnceWatch.calls == 1:
            raise ApiException(status=410, reason="Expired")
        time.sleep(2)
        yield from ()

    def stop(self):
        pass


def deleted(_index: int, pods: dict) -> bool:
    return any(p.get(DELETED_MARK) for p in pods.values())


def test_a_relist_keeps_a_pod_deleted_while_no_watch_ran_as_deleted(monkeypatch):
    # Pod a (episode 0) is deleted in the gap a 410 leaves: its DELETED event never comes, and
    # the second listing no longer has it. Dropped, its episode read Pending until its deadline.
    GoneOnceWatch.calls = 0
    monkeypatch.setattr(watch, "RawWatch", GoneOnceWatch)
    listings = [[pod("a", 0, "Running"), pod("b", 1, "Running")], [pod("b", 1, "Running")]]

    def listing() -> dict:
        items = listings.pop(0) if len(listings) > 1 else listings[0]
        return {"items": items, "metadata": {"resourceVersion": "1"}}

    w = watch.PodWatch("ns", listing, (None, (), {}), lambda p: int(p["metadata"]["labels"][INDEX]))
    try:
        end = time.monotonic() + 5
        while w.lists < 2:
            assert time.monotonic() < end, "the watch never listed again after its 410"
            time.sleep(0.01)
        assert w.wait_any([0, 1], 0.2, deleted, caller="waker") == [0]
        pods = w.wait(0, 0.1, lambda pods: True)
        assert pods["a"][DELETED_MARK] is True and pods["a"]["status"]["phase"] == "Running"
    finally:
        w.stop()


def test_an_episode_returned_to_a_caller_is_checked_again_on_its_next_call(monkeypatch):
    # The waker that got an ended episode may fail before it unparks it: with no new event, a
    # cursor that counted it checked never returned it again.
    w = scripted_watch(monkeypatch, [], [pod("a", 0, "Succeeded"), pod("b", 1, "Running")])
    checked: list[int] = []
    try:
        assert w.wait_any([0, 1], 5, counting_ended(checked), caller="waker") == [0]
        checked.clear()
        assert w.wait_any([0, 1], 0.2, counting_ended(checked), caller="waker") == [0]
        assert checked.count(1) == 0  # still only what is owed a look: 1 had no event
    finally:
        w.stop()

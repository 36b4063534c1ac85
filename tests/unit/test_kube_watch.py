"""The shared Pod watch, against a scripted watch stream (no API server)."""

from __future__ import annotations

import json
import time

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

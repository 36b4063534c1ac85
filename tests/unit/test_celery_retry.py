"""`tasks._run` turns core's `Again` into Celery's retry; Celery's own `Task.retry` decides
whether the budget is spent (only the message it would send is stubbed). A parked collect ends
as Celery's trace sees it."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.app import trace
from celery.exceptions import MaxRetriesExceededError, Retry

from rollout_worker import core, tasks


class Sig:
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}

    def __init__(self) -> None:
        self.sent = 0

    def apply_async(self, *args: Any, **kwargs: Any) -> None:
        self.sent += 1


@pytest.fixture
def task(monkeypatch):
    app = Celery("unit", broker="memory://", backend="cache+memory://")

    @app.task(bind=True, max_retries=2)
    def t(self):  # pragma: no cover - never run, only its retry is called
        return None

    sig = Sig()
    monkeypatch.setattr(t, "signature_from_request", lambda *a, **kw: sig)
    t.push_request(id="m1", retries=2, called_directly=False, is_eager=False)
    yield t, sig
    t.pop_request()


def again(**kwargs: Any):
    def call() -> None:
        raise core.Again(1.0, **kwargs)

    return call


def test_a_counted_again_beyond_the_budget_fails(task):
    t, sig = task
    with pytest.raises(MaxRetriesExceededError):
        tasks._run(t, again())
    assert sig.sent == 0


def test_an_uncounted_again_runs_again_whatever_the_retries_so_far(task):
    t, sig = task
    with pytest.raises(Retry):
        tasks._run(t, again(counted=False))
    assert sig.sent == 1


def test_a_parked_collect_ends_with_no_result_no_chord_count_and_no_traceback(monkeypatch):
    """Celery's own trace runs the task: a parked collect is acknowledged like `Ignore` (no
    result stored, its chord part not counted: the resent copy gives both) without Celery
    building a traceback for it. A collect that returns a row is traced the same way and is
    stored and counted, so the stubs below can see both."""
    app = Celery("unit", broker="memory://", backend="cache+memory://")
    parked: list[str] = []

    class Parking:
        def park(self, parking: core.Park, message: str) -> bool:
            parked.append(message)
            return True

    monkeypatch.setattr(tasks, "worker", lambda _app: Parking())
    counted: list[str] = []
    monkeypatch.setattr(
        app.backend, "on_chord_part_return", lambda request, state, result: counted.append(state)
    )
    tracebacks: list[Any] = []
    real_info = trace.ExceptionInfo

    def info(*args: Any, **kwargs: Any) -> Any:
        tracebacks.append(args)
        return real_info(*args, **kwargs)

    monkeypatch.setattr(trace, "ExceptionInfo", info)

    def park() -> None:
        raise core.Park("b1", 3)

    @app.task(bind=True, acks_late=True)
    def collect(self, outcome: str) -> Any:
        return tasks._run(self, park if outcome == "park" else lambda: {"index": 3})

    tracer = trace.build_tracer(collect.name, collect, app=app)
    chord_request = {"chord": {"task": "aggregate", "args": [], "kwargs": {}}, "group": "g1"}
    for task_id, outcome in (("parked", "park"), ("recorded", "row")):
        tracer(task_id, (outcome,), {}, {"id": task_id, "args": [outcome], **chord_request})

    assert len(parked) == 1 and '"parked"' in parked[0]  # its message, for the waker
    assert app.backend.get_task_meta("parked")["status"] == "PENDING"  # no result stored
    assert app.backend.get_task_meta("recorded")["status"] == "SUCCESS"
    assert counted == ["SUCCESS"]  # the recorded one only
    assert tracebacks == []

"""`tasks._run` turns core's `Again` into Celery's retry; Celery's own `Task.retry` decides
whether the budget is spent (only the message it would send is stubbed)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
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

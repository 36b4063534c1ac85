"""`auto` isolation means bubblewrap: a bwrap that does not work refuses the batch before
anything is created; running unsandboxed takes an explicit `none`."""

from __future__ import annotations

import sys

import pytest

from rollout_wire.errors import BackendUnavailable
from rollout_wire.request import parse_spec
from rollout_worker.backends.local import backend as local
from rollout_worker.settings import Settings

REASON = "bwrap cannot create namespaces: setting up uid map: Permission denied"


@pytest.fixture
def broken_bwrap(monkeypatch):
    monkeypatch.setattr(local, "probe_bwrap", lambda: REASON)
    # pytest's own folders are closed to others: not what these tests are about.
    monkeypatch.setattr(local, "_closed_to_others", lambda _: None)

    def no_supervisor(*_: object) -> None:
        raise AssertionError("a supervisor was started without a sandbox")

    monkeypatch.setattr(local, "spawn_detached", no_supervisor)


def backend(tmp_path, isolation: str) -> local.LocalBackend:
    settings = Settings(
        local_root=tmp_path / "runs", local_python=sys.executable, local_isolation=isolation
    )
    return local.LocalBackend(settings)


def batch():
    return parse_spec({"count": 1, "backend": "local"}, max_episodes=10)


@pytest.mark.parametrize("isolation", ["auto", "bwrap"])
def test_a_bwrap_that_does_not_work_refuses_the_batch_with_why_and_how(
    tmp_path, broken_bwrap, isolation
):
    local_backend, spec = backend(tmp_path, isolation), batch()
    with pytest.raises(BackendUnavailable) as refused:
        local_backend.preflight(spec)
    assert REASON in str(refused.value) and "ROLLOUT_LOCAL_ISOLATION=none" in str(refused.value)
    with pytest.raises(BackendUnavailable, match="ROLLOUT_LOCAL_ISOLATION=none"):
        local_backend.start_run(spec, lambda _: None)
    assert not (tmp_path / "runs" / spec.batch_id).exists()  # nothing was created


def test_only_an_explicit_none_runs_unsandboxed_and_says_so(tmp_path, broken_bwrap):
    warnings = backend(tmp_path, "none").preflight(batch())
    assert any("NOT isolated" in w and "ROLLOUT_LOCAL_ISOLATION=none" in w for w in warnings)

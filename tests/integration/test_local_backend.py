"""The local backend on its own: real supervisor, real sandboxed processes, no Redis."""

import json
import time

import pytest

from rollout_worker.backends.local import LocalBackend
from rollout_worker.backends.local_files import RunDir
from rollout_wire.errors import OwnershipError
from rollout_worker.models import parse_spec
from rollout_worker.settings import Settings
from rollout_worker.validation import validate_episode


@pytest.fixture
def backend(tmp_path):
    return LocalBackend(Settings(local_root=tmp_path / "runs"))


def run_all(backend, handle, count, timeout=60):
    observations = []
    for index in range(count):
        obs = backend.wait_episode(handle, index, timeout)
        assert obs.terminal, obs
        observations.append(obs)
    return observations


def test_runs_each_episode_once_in_its_own_workspace_with_bounded_parallelism(backend):
    spec = parse_spec({"count": 6, "parallelism": 2}, max_episodes=10)
    receipt = {}
    handle = backend.start_run(spec, receipt.update)
    again = backend.start_run(spec, receipt.update)  # a redelivered submit
    assert again["origin"] == handle["origin"] and again["run_uid"] == handle["run_uid"]
    assert receipt["run"]["run_uid"] == handle["run_uid"]
    observations = run_all(backend, handle, 6)
    rows = [
        validate_episode(o, backend.read_output(handle, o), handle["origin"]) for o in observations
    ]
    assert [r.status for r in rows] == ["ok"] * 6, [r.errors for r in rows]
    assert len({r.pod for r in rows}) == 6
    # Each episode ran exactly once: one ready line per log, even after the second start.
    for obs in observations:
        assert backend.read_output(handle, obs).count('"ready"') == 1
    # Parallelism 2: never more than two episodes alive at the same time.
    spans = sorted((o.created_at, o.finished_at) for o in observations)
    for start, _ in spans:
        alive = sum(1 for s, f in spans if s <= start < f)
        assert alive <= 2
    run_dir = RunDir(backend.root / spec.batch_id)
    assert not list((run_dir.path / "ws").iterdir())  # workspaces die with their episode
    backend.delete_run(handle)
    assert not run_dir.path.exists()


def test_deadlines_kill_hung_episodes_and_unstarted_ones_fail(backend):
    spec = parse_spec(
        {
            "count": 3,
            "parallelism": 1,
            "action": "hang",
            "deadline_seconds": 3,
            "episode_timeout_seconds": 1,
        },
        max_episodes=10,
    )
    handle = backend.start_run(spec, lambda _: None)
    started = time.monotonic()
    observations = run_all(backend, handle, 3, timeout=30)
    assert time.monotonic() - started < 10
    assert all(o.phase == "Failed" and o.reason == "DeadlineExceeded" for o in observations)
    row = validate_episode(
        observations[0], backend.read_output(handle, observations[0]), handle["origin"]
    )
    assert row.status == "failed" and row.reward == 0
    assert any("DeadlineExceeded" in e for e in row.errors)


def test_delete_refuses_a_run_it_cannot_prove_it_created(backend, tmp_path):
    spec = parse_spec({"count": 1}, max_episodes=10)
    handle = backend.start_run(spec, lambda _: None)
    run_all(backend, handle, 1)
    forged = dict(handle, run_uid="someone-else")
    with pytest.raises(OwnershipError, match="do not match the receipt"):
        backend.delete_run(forged)
    outside = dict(handle, run_dir=str(tmp_path))
    with pytest.raises(OwnershipError, match="not under"):
        backend.delete_run(outside)
    decoy = backend.root / "decoy"
    decoy.mkdir()
    (decoy / "run.json").write_text(json.dumps({"owner": "someone", "run_uid": "x"}))
    with pytest.raises(OwnershipError):
        backend.delete_run(dict(handle, run_dir=str(decoy), run_uid="x"))
    assert decoy.exists()
    backend.delete_run(handle)
    backend.delete_run(handle)  # already gone: not an error


def test_delete_stops_a_running_batch(backend):
    spec = parse_spec({"count": 4, "parallelism": 2, "action": "hang"}, max_episodes=10)
    handle = backend.start_run(spec, lambda _: None)
    time.sleep(0.5)
    backend.delete_run(handle)
    assert not (backend.root / spec.batch_id).exists()

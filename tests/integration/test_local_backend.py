"""The local backend on its own: real supervisor, real sandboxed processes, no Redis."""

import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from rollout_wire.errors import OwnershipError
from rollout_wire.request import parse_spec
from rollout_worker.backends.local.backend import LocalBackend
from rollout_worker.backends.local.files import RunDir
from rollout_worker.settings import Settings
from rollout_worker.validation import validate_episode


@pytest.fixture
def backend(open_tmp_path):
    return LocalBackend(Settings(local_root=open_tmp_path / "runs"))


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
    assert again.origin == handle.origin and again.run_uid == handle.run_uid
    assert receipt["run"]["run_uid"] == handle.run_uid
    observations = run_all(backend, handle, 6)
    rows = [
        validate_episode(o, backend.read_output(handle, o), handle.origin) for o in observations
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
        observations[0], backend.read_output(handle, observations[0]), handle.origin
    )
    assert row.status == "failed" and row.reward == 0
    assert any("DeadlineExceeded" in e for e in row.errors)


def test_delete_refuses_a_run_it_cannot_prove_it_created(backend, tmp_path):
    spec = parse_spec({"count": 1}, max_episodes=10)
    handle = backend.start_run(spec, lambda _: None)
    run_all(backend, handle, 1)
    forged = replace(handle, run_uid="someone-else")
    with pytest.raises(OwnershipError, match="do not match the receipt"):
        backend.delete_run(forged)
    outside = replace(handle, run_dir=str(tmp_path))
    with pytest.raises(OwnershipError, match="not under"):
        backend.delete_run(outside)
    decoy = backend.root / "decoy"
    decoy.mkdir()
    (decoy / "run.json").write_text(json.dumps({"owner": "someone", "run_uid": "x"}))
    with pytest.raises(OwnershipError):
        backend.delete_run(replace(handle, run_dir=str(decoy), run_uid="x"))
    assert decoy.exists()
    assert backend.delete_run(handle) is True
    assert backend.delete_run(handle) is True  # already gone: not an error


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def run_processes(run_dir: Path, batch_id: str) -> dict[int, str]:
    """pid -> what it is, for every live process of this run: its supervisor, its sandboxes
    (bwrap) and the episode processes inside them (found by their EPISODE_ID). Zombies are
    dead: they hold no resources and are not counted."""
    marker = str(run_dir).encode()
    episode = f"EPISODE_ID=rollout-{batch_id}-".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read(entry / "stat")
        if not stat or stat.rsplit(b")", 1)[1].split()[0] == b"Z":
            continue
        argv = _read(entry / "cmdline").split(b"\0")
        if b"rollout_worker.backends.local.supervisor" in argv and marker in argv:
            found[int(entry.name)] = "supervisor"
        elif argv[0].endswith(b"bwrap") and any(marker in a for a in argv):
            found[int(entry.name)] = "bwrap"
        elif any(v.startswith(episode) for v in _read(entry / "environ").split(b"\0")):
            found[int(entry.name)] = "episode"
    return found


def test_delete_stops_a_running_batch(backend):
    spec = parse_spec({"count": 4, "parallelism": 2, "action": "hang"}, max_episodes=10)
    handle = backend.start_run(spec, lambda _: None)
    run_dir = Path(handle.run_dir)
    kinds = {"supervisor": 1, "episode": 2}  # two hanging episodes (parallelism 2)
    if handle.isolation == "bwrap":
        kinds["bwrap"] = 2
    deadline = time.monotonic() + 20
    while True:
        before = run_processes(run_dir, spec.batch_id)
        counts = Counter(before.values())
        if all(counts[kind] >= n for kind, n in kinds.items()):
            break
        assert time.monotonic() < deadline, f"the run never got going: {before}"
        time.sleep(0.1)
    episodes = {pid for pid, kind in before.items() if kind == "episode"}
    backend.delete_run(handle)
    assert not (backend.root / spec.batch_id).exists()
    # Once delete returns, no sandbox and no process inside one can run any more: each is
    # gone, a zombie, or already in the kernel's exit path (killed).
    sandboxes = {pid: _life(pid) for pid, kind in before.items() if kind != "supervisor"}
    assert set(sandboxes.values()) <= {"gone", "zombie", "exiting"}, (sandboxes, before)
    # The supervisor releases its lock (which delete waits for) on its way out, after it has
    # reaped every sandbox, and exits a moment later. Then nothing of the run is left.
    deadline = time.monotonic() + 5
    while any(_life(pid) not in ("gone", "zombie") for pid in before):
        assert time.monotonic() < deadline, {pid: _life(pid) for pid in before}
        time.sleep(0.01)
    assert run_processes(run_dir, spec.batch_id) == {}
    assert episodes  # what was checked included the episodes themselves


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def _life(pid: int) -> str:
    """gone | zombie | exiting | alive, from /proc/PID/stat (state and flags)."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    if not stat:
        return "gone"
    fields = stat.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X"):
        return "zombie"
    return "exiting" if int(fields[6]) & PF_EXITING else "alive"

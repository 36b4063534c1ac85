"""Warm pools on the local backend (issue 15): a pool process keeps bwrap sandboxes waiting for
their episode; a run's supervisor takes them, and every guarantee of a cold local episode holds
(isolation, validation, one sandbox per episode, counted once, drain on demand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_wire import constants as k
from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers]

SIZE = 3


def _pool_dirs(root: Path) -> list[Path]:
    pools = root / "_pools"
    return sorted(pools.iterdir()) if pools.is_dir() else []


def _waiting(root: Path) -> int:
    total = 0
    for path in _pool_dirs(root):
        try:
            total += json.loads((path / "state.json").read_text())["waiting"]
        except (OSError, ValueError):
            continue
    return total


def _sandboxes_of(pool_dir: Path) -> list[int]:
    """Host pids of the bwrap processes that run this pool's sandboxes."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"bwrap") and str(pool_dir).encode() in b" ".join(argv):
            pids.append(int(entry.name))
    # bwrap forks once more for the sandbox's PID namespace: keep the outer one of each.
    return [pid for pid in pids if _parent(pid) not in pids]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _pythons_under(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if b"python" in Path(f"/proc/{p}/comm").read_bytes()]


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def test_local_batches_take_episodes_from_a_warm_pool(open_tmp_path):
    root = open_tmp_path / "runs"
    env = {"ROLLOUT_LOCAL_ROOT": str(root), "ROLLOUT_LOCAL_ISOLATION": "bwrap"}
    with LocalStack(collectors=2, extra_env=env) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        first = client.submit(count=2, parallelism=2, warm_pool=SIZE)
        assert client.wait(first.batch_id, timeout=120)["successful_episodes"] == 2
        deadline = time.monotonic() + 60
        while _waiting(root) < SIZE:
            assert time.monotonic() < deadline, _waiting(root)
            time.sleep(0.1)
        (pool_dir,) = _pool_dirs(root)

        # Each waiting sandbox is a bwrap sandbox like a cold one: its own network (none),
        # no capabilities, uid 1000 inside and on the host.
        bwraps = _sandboxes_of(pool_dir)
        assert len(bwraps) == SIZE, bwraps
        for pid in bwraps:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"--unshare-all" in argv and argv[argv.index(b"--cap-drop") + 1] == b"ALL"
            # The pool counts a sandbox waiting once bwrap started it; its python may still be
            # a moment from exec (then its comm is still bwrap's).
            deadline = time.monotonic() + 10
            while not (inside := _pythons_under(pid)):
                assert time.monotonic() < deadline, _descendants(pid)
                time.sleep(0.05)
            status = Path(f"/proc/{inside[-1]}/status").read_text()
            assert "\nUid:\t1000\t1000\t1000\t1000" in status
            assert "\nCapEff:\t0000000000000000" in status
            assert os.readlink(f"/proc/{inside[-1]}/ns/net") != os.readlink("/proc/self/ns/net")

        second = client.submit(count=SIZE + 1, parallelism=SIZE + 1, warm_pool=SIZE)
        report = client.wait(second.batch_id, timeout=120)
        assert report["successful_episodes"] == SIZE + 1, report
        rows = {row["index"]: row for row in report["pods"]}
        assert sorted(rows) == list(range(SIZE + 1))  # each episode counted once
        warm = [row for row in rows.values() if "pool_created_at" in row["timing"]]
        assert len(warm) == SIZE, rows
        for row in warm:
            assert row["timing"]["pool_created_at"] < row["created_at"] <= row["ready_at"]
            assert 0 <= row["timing"]["handover_seconds"] < 1, row
            log = client.redis.hget(k.logs_key(second.batch_id), str(row["index"])).decode()
            events = [json.loads(line) for line in log.splitlines() if line.strip()]
            assert [e["event"] for e in events] == ["ready", "reward"]
            assert all(e["episode_id"] == row["pod"] for e in events)
        # The sandboxes it took are gone; the pool refilled behind it (never reused).
        deadline = time.monotonic() + 30
        while set(_sandboxes_of(pool_dir)) & set(bwraps) or _waiting(root) < SIZE:
            assert time.monotonic() < deadline, (_sandboxes_of(pool_dir), bwraps)
            time.sleep(0.1)

        # A batch of three waves: each freed slot takes a waiting sandbox, and the pool starts
        # a replacement for each one taken, so every episode of every wave starts warm.
        waves = client.submit(count=3 * SIZE, parallelism=SIZE)
        report = client.wait(waves.batch_id, timeout=120)
        assert report["successful_episodes"] == 3 * SIZE, report
        rows = sorted(report["pods"], key=lambda row: row["index"])
        assert [row["index"] for row in rows] == list(range(3 * SIZE))
        assert all("pool_created_at" in row["timing"] for row in rows), rows
        # One sandbox per episode: each was started by the pool at its own moment.
        assert len({row["timing"]["pool_created_at"] for row in rows}) == 3 * SIZE

        # Drained on demand: its sandboxes stop, its process exits, its folder goes.
        drain = [sys.executable, "-m", "rollout_worker.cli", "pools", "--backend", "local"]
        run_env = {**os.environ, **env, "ROLLOUT_REDIS_URL": stack.redis_url}
        deadline = time.monotonic() + 60
        while pool_dir.exists():
            done = subprocess.run(
                [*drain, "--drain"], capture_output=True, text=True, timeout=60, env=run_env
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert time.monotonic() < deadline, done.stdout
            time.sleep(0.5)
        assert not _sandboxes_of(pool_dir)
        client.close()

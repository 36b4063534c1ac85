"""Episodes that attack the collector: floods, a giant line, binary noise, forged, duplicated and
reordered events, a skewed clock. Run through the real pipeline (real supervisor, sandboxes,
Celery workers, Redis). The program each sandbox runs is a hostile stand-in for the episode
program, placed where the run's program goes before the run starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollout_wire import constants as k
from rollout_wire.request import new_batch_id
from rollout_worker.backends.base import MAX_LOG_BYTES
from rollout_worker.backends.local.files import RunDir
from rollout_worker.core import STORED_LOG_BYTES

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

# Each episode index misbehaves in its own way; the last one is honest.
HOSTILE = r"""
import json, os, sys, time
me = os.environ["EPISODE_ID"]
index = int(me.rsplit("-", 1)[1])
out = sys.stdout.buffer
def event(name, at=None, episode=me, **data):
    line = {"event": name, "at": time.time() if at is None else at, "episode_id": episode}
    line.update(data)
    out.write(json.dumps(line).encode() + b"\n"); out.flush()
good = dict(reward=1, baseline_exit=1, tests_exit=0, tests_output="OK")
if index == 0:    # a flood: a gigabyte of lines
    chunk = (b"A" * 1023 + b"\n") * 1024
    for _ in range(1024):
        out.write(chunk)
elif index == 1:  # one giant line, no newline
    for _ in range(64):
        out.write(b"B" * 2**20)
elif index == 2:  # binary noise, then good events
    out.write(os.urandom(2**20)); out.write(b"\n"); event("ready"); event("reward", **good)
elif index == 3:  # forged: the reward names another episode
    event("ready"); event("reward", episode=me[:-1] + "7", **good)
elif index == 4:  # duplicated events
    event("ready"); event("ready"); event("reward", **good); event("reward", **good)
elif index == 5:  # out of order: reward before ready
    now = time.time(); event("reward", at=now, **good); event("ready", at=now + 0.5)
elif index == 6:  # a skewed clock: an hour ahead
    now = time.time() + 3600; event("ready", at=now); event("reward", at=now + 0.1, **good)
else:             # honest
    event("ready"); event("reward", **good)
out.flush()
"""


def vm_peak_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))


def test_hostile_episodes_are_contained_and_never_rewarded(stack, client):
    batch_id = new_batch_id()
    program = RunDir(Path(stack.env["ROLLOUT_LOCAL_ROOT"]) / batch_id).program
    program.parent.mkdir(parents=True)
    program.write_text(HOSTILE)
    program.chmod(0o644)
    program.parent.parent.chmod(0o755)
    program.parent.chmod(0o755)
    report = client.submit(batch_id=batch_id, count=8, parallelism=8).wait(300)
    rows = {row["index"]: row for row in report["pods"]}
    assert report["collected_episodes"] == 8 and len(rows) == 8
    # Only the honest episode is rewarded; every hostile one failed, with its reason.
    assert rows[7]["status"] == "ok" and report["reward_sum"] == 1, rows[7]["errors"]
    for index in range(7):
        assert rows[index]["status"] == "failed" and rows[index]["reward"] == 0, rows[index]
    errors = {i: " | ".join(rows[i]["errors"]) for i in range(7)}
    assert "LogLimitExceeded" in errors[0] and "more lines that are not events" in errors[0]
    assert "LogLimitExceeded" in errors[1]
    assert "not a JSON event" in errors[2]
    assert "names episode" in errors[3]
    assert "exactly one ready and one reward" in errors[4]
    # Reward stamped half a second before ready: the pair is named, in that order.
    order = r"time order violated: ready \([\d.]+\) is after reward \([\d.]+\)"
    assert re.search(order, errors[5]), errors[5]
    # A clock an hour ahead: its events are stamped after the sandbox ended, by that hour.
    skew = re.search(
        r"time order violated: an event is stamped ([\d.]+), after the sandbox ended "
        r"\(([\d.]+)\); check clock synchronisation",
        errors[6],
    )
    assert skew, errors[6]
    stamped, ended = float(skew[1]), float(skew[2])
    assert 3590 < stamped - ended < 3601, (stamped, ended)
    # What is kept is capped, and says so.
    logs = client.logs(batch_id)
    for index in (0, 1):
        assert len(logs[index].encode()) <= STORED_LOG_BYTES + 200
        assert "[rollout: log stored cut at" in logs[index]
    on_disk = Path(report["run"]["run_dir"]) / "logs" / "0.log"
    assert not on_disk.exists() or on_disk.stat().st_size <= MAX_LOG_BYTES + 200
    row_bytes = len(json.dumps(rows[0]))
    assert row_bytes < 10_000, row_bytes  # a flood is one counted problem, not a million
    # The stream carried each episode once.
    entries = client.redis.xrange(k.stream_key(batch_id))
    episodes = [e for _, e in entries if e[b"type"] == k.ENTRY_EPISODE.encode()]
    assert len(episodes) == 8
    peaks = {w.name: vm_peak_kib(w.proc.pid) for w in stack.workers if w.proc.poll() is None}
    print(f"worker peak memory (VmHWM, KiB): {peaks}")
    assert max(peaks.values()) < 400 * 1024, peaks

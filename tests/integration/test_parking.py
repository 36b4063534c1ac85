"""Parked collectors end to end on the local backend (real Redis, real Celery workers, real
bubblewrap sandboxes): a collector whose episode outlasts its block leaves its message for the
batch's waker instead of requeueing itself every block, and the waker records the episode
the moment it ends. The chord still counts each episode once."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from rollout_worker.cli.policy_server import running
from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

BLOCK_SECONDS = 1
EPISODE_SECONDS = 8  # each run turn sleeps this long: 8 collect blocks
EPISODES = 4
PASSING_TEST = (
    "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n\n\n"
    "if __name__ == '__main__':\n    unittest.main()\n"
)
SCRIPT = {
    "tasks": {
        f"slow-{i}": {
            "plans": [
                [
                    {"tool": "run", "arguments": {"command": f"sleep {EPISODE_SECONDS}"}},
                    {"tool": "submit", "arguments": {}},
                ]
            ]
        }
        for i in range(EPISODES)
    }
}


def worker_logs(stack: LocalStack) -> str:
    return "".join(w.log.read_text(errors="replace") for w in stack.workers)


def task(task_id: str) -> dict:
    return {
        "id": task_id,
        "statement": f"Task {task_id}.",
        "files": {"notes.txt": "wait\n"},
        "test_files": {"test_ok.py": PASSING_TEST},
        "test_command": ["python", "-B", "test_ok.py"],
        "baseline": False,
        "max_steps": 5,
    }


def test_long_episodes_are_collected_by_parked_collectors_and_each_is_counted_once():
    env = {"ROLLOUT_COLLECT_BLOCK_SECONDS": str(BLOCK_SECONDS)}
    with (
        LocalStack(collectors=1, extra_env=env) as stack,
        running(script=SCRIPT) as server,
    ):
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        try:
            batch = client.submit(
                tasks=[task(name) for name in SCRIPT["tasks"]],
                parallelism=EPISODES,
                policy={"url": server.url},
            )
            report = client.wait(batch.batch_id, timeout=180)
        finally:
            client.close()
        # The waker's last look (its "nothing parked") may come a moment after the report.
        done = f"waker of {batch.batch_id}: nothing parked"
        deadline = time.monotonic() + 15
        while done not in (logs := worker_logs(stack)) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert report["status"] == "succeeded", report["errors"]
    # Reported by the chord: every collector's result counted (a parked task gives none).
    assert report["finalized_by"] == "chord"
    rows = report["pods"]
    assert sorted(r["index"] for r in rows) == list(range(EPISODES))
    assert all(r["status"] == "ok" and r["reward"] == 1 for r in rows), rows
    # Requeued every block, each collector would have run about 8 times; parked, it runs
    # when it starts, maybe once more before its sandbox runs; the waker records it once its
    # episode ended, without running its task again.
    runs = Counter(re.findall(r"Task rollout\.collect_episode\[(\S+)\] received", logs))
    assert len(runs) == EPISODES and max(runs.values()) <= 2, runs
    recorded = {
        int(i) for i in re.findall(rf"waker of {batch.batch_id}: #(\d+) recorded here", logs)
    }
    # On a loaded machine a first collect can start late enough to find its episode over;
    # every other one is the waker's.
    assert recorded, logs[-3000:]
    assert len(recorded) >= EPISODES - 1, (recorded, logs[-3000:])
    # The batch's one waker, a thread of the collector that parked first, ended with the batch.
    assert logs.count(done) == 1, logs[-3000:]
    # The waker sends a collector again the moment its episode ends, not a block later.
    last_end = max(r["finished_at"] for r in rows)
    assert report["reported_at"] - last_end < 3, (report["reported_at"], last_end)


def test_the_wakers_one_round_trip_look_renews_its_lease_and_reads_what_it_acts_on():
    """The waker's look (one Lua call on a real redis-server) renews only its own lease, and
    reads back what collectors, the callback and a cancel wrote through the store."""
    from rollout_wire import constants as k
    from rollout_worker.core.state import FLAG_CANCEL
    from rollout_worker.store import Store

    stack = LocalStack()
    stack.start_redis()
    try:
        store, batch_id = Store.from_url(stack.redis_url, ttl=600), "look"
        store.park(batch_id, 3, "m3", until_ready=True)
        store.park(batch_id, 1, "m1", until_ready=False)
        first = store.waker_look(batch_id, "a", 10.0, FLAG_CANCEL)
        other = store.waker_look(batch_id, "b", 10.0, FLAG_CANCEL)
        lease_ms = store.redis.pttl(k.waker_key(batch_id))
        store.set_flag(batch_id, FLAG_CANCEL)
        store.publish_report(batch_id, {"batch_id": batch_id, "status": "cancelled"})
        store.unpark(batch_id, 3)
        last = store.waker_look(batch_id, "a", 10.0, FLAG_CANCEL)
    finally:
        stack.stop()
    assert (first.held, first.parked, set(first.until_ready)) == (True, [1, 3], {3})
    assert (first.reported, first.cancelled) == (False, False)
    assert not other.held and other.parked == []  # another's lease: nothing read
    assert 9000 < lease_ms <= 10000
    assert (last.held, last.parked, last.reported, last.cancelled) == (True, [1], True, True)

"""A collector killed with SIGKILL mid-batch: its tasks come back, nothing is lost or doubled."""

import signal

import pytest

from rollout_worker.stack import LocalStack
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_killed_collector_loses_nothing_and_counts_nothing_twice():
    env = {"ROLLOUT_VISIBILITY_TIMEOUT": "10", "ROLLOUT_COLLECT_BLOCK_SECONDS": "1"}
    with LocalStack(collectors=2, collect_concurrency=4, extra_env=env) as stack:
        client = RolloutClient(stack.redis_url)
        submission = client.submit(count=40, parallelism=4)
        next(client.stream(submission.batch_id, timeout=60))  # the batch is under way
        victim = next(w for w in stack.workers if w.name == "collect1")
        stack.stop_worker(victim, sig=signal.SIGKILL)
        report = client.wait(submission.batch_id, timeout=180)
        assert report["ok"] is True, report["errors"]
        assert report["finalized_by"] == "chord"  # the chord completed, not the watchdog
        assert report["successful_episodes"] == 40 and report["reward_sum"] == 40
        assert sorted(row["index"] for row in report["pods"]) == list(range(40))
        assert len(client.redis.hkeys(f"rollout:batch:{submission.batch_id}:episodes")) == 40
        client.close()

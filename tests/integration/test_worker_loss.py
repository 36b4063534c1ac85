"""A collector killed with SIGKILL mid-batch: its tasks come back, nothing is lost or doubled."""

import os
import signal
import time

import pytest

from rollout_wire import constants as k
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


def test_a_killed_local_supervisor_is_revived_and_its_lost_episodes_reported():
    env = {"ROLLOUT_COLLECT_BLOCK_SECONDS": "1"}
    with LocalStack(collectors=1, extra_env=env) as stack:
        client = RolloutClient(stack.redis_url)
        submission = client.submit(count=30, parallelism=3)
        next(client.stream(submission.batch_id, timeout=60))
        pid_file = stack.dir / "runs" / submission.batch_id / "supervisor.pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        report = client.wait(submission.batch_id, timeout=120)
        rows = report["pods"]
        assert sorted(row["index"] for row in rows) == list(range(30))
        lost = [row for row in rows if row["status"] != "ok"]
        assert report["successful_episodes"] == 30 - len(lost)
        assert report["reward_sum"] == 30 - len(lost)
        assert report["successful_episodes"] > 0  # the revived supervisor ran the rest
        # Episodes killed with the supervisor are failed, never silently rerun or dropped.
        assert all("SupervisorLost" in " ".join(row["errors"]) for row in lost)
        assert report["ok"] is (not lost)
        client.close()


def test_a_stalled_run_is_reported_with_lost_episodes_after_its_deadline():
    env = {"ROLLOUT_COLLECT_BLOCK_SECONDS": "1", "ROLLOUT_COLLECT_GRACE_SECONDS": "2"}
    with LocalStack(collectors=1, extra_env=env) as stack:
        client = RolloutClient(stack.redis_url)
        submission = client.submit(count=20, parallelism=2, deadline_seconds=6)
        next(client.stream(submission.batch_id, timeout=60))
        pid = int((stack.dir / "runs" / submission.batch_id / "supervisor.pid").read_text())
        os.kill(pid, signal.SIGSTOP)  # alive but making no progress
        try:
            report = client.wait(submission.batch_id, timeout=90)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert report["ok"] is False
        assert report["finalized_by"] == "chord"  # collectors retried past Celery's default 3
        assert sorted(row["index"] for row in report["pods"]) == list(range(20))
        assert report["lost_episodes"] > 0
        assert (
            report["successful_episodes"] + report["lost_episodes"] + report["failed_episodes"]
            == 20
        )
        lost = [row for row in report["pods"] if row["status"] == "lost"]
        assert all("deadline" in " ".join(row["errors"]) for row in lost)
        client.close()


def test_the_watchdog_collects_a_batch_whose_collection_tasks_were_lost():
    env = {"ROLLOUT_COLLECT_GRACE_SECONDS": "1"}
    with LocalStack(collectors=1, extra_env=env) as stack:
        collector = next(w for w in stack.workers if w.name == "collect1")
        stack.stop_worker(collector)  # nobody consumes `collect`
        client = RolloutClient(stack.redis_url)
        submission = client.submit(count=5, parallelism=5, deadline_seconds=3)
        deadline = time.monotonic() + 30
        while client.redis.llen(k.QUEUE_COLLECT) < 5:
            assert time.monotonic() < deadline, "the chord was never dispatched"
            time.sleep(0.1)
        client.redis.delete(k.QUEUE_COLLECT)  # the messages are gone for good
        report = client.wait(submission.batch_id, timeout=120)
        assert report["finalized_by"] == "watchdog"
        # The episodes themselves ran: the watchdog collects them instead of dropping them.
        assert report["ok"] is True, report["errors"]
        assert report["reward_sum"] == 5
        assert sorted(row["index"] for row in report["pods"]) == list(range(5))
        client.close()

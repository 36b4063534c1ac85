"""Redis as production runs it (AOF, a password, TLS), and Redis going away mid-batch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rollout_wire.errors import RedisUnavailable
from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_workers_trainer_and_cli_use_a_password_and_tls():
    with LocalStack(collectors=1, tls=True, password="s3cret-pw") as stack:
        assert stack.redis_url.startswith("rediss://:s3cret-pw@")
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        report = client.submit(count=4, parallelism=2).wait(120)
        assert (report["status"], report["reward_sum"]) == ("succeeded", 4)
        check = subprocess.run(
            [sys.executable, "-m", "rollout_worker.cli", "check", "--redis-url", stack.redis_url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KUBECONFIG": ""},
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "queue collect: 1 worker(s)" in check.stdout
        # Without the password the server refuses: the password is really in force.
        plain = stack.redis_url.replace(":s3cret-pw@", "")
        with pytest.raises(Exception, match=r"(?i)auth"):
            RolloutClient(plain).redis.ping()
        client.close()


def test_a_redis_restart_mid_batch_loses_nothing_with_an_append_only_file():
    with LocalStack(collectors=2, aof=True) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        batch = client.submit(count=40, parallelism=4)
        for seen, _row in enumerate(batch.stream(timeout=60), start=1):
            if seen == 8:
                break
        stack.restart_redis(down_seconds=2.0)
        report = batch.wait(300)
        assert (report["episodes"], report["collected_episodes"]) == (40, 40)
        assert (report["successful_episodes"], report["reward_sum"]) == (40, 40), report["errors"]
        assert sorted(row["index"] for row in report["pods"]) == list(range(40))
        client.close()


def test_redis_gone_for_good_ends_the_trainers_wait_with_a_clear_error():
    with LocalStack(collectors=1) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url, outage_seconds=5)
        batch = client.submit(count=4, action="hang", deadline_seconds=600)
        stack.stop_redis()
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match="unreachable for 5s"):
            batch.wait(timeout=None)
        assert time.monotonic() - started < 30

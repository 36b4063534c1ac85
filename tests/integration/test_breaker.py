"""The circuit breaker, end to end: a batch whose policy endpoint is dead halts itself after
`max_consecutive_infra_failures` instead of failing every episode (real Redis, real workers,
the local backend's sandboxes)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.stack import free_port
from tests.integration.procs import sandbox_processes

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_a_dead_policy_endpoint_halts_the_batch_after_n_failures_with_nothing_left(client):
    limit, parallelism = 4, 3
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tasks = load_task_set("bundled")
    batch = client.submit(
        tasks=tasks,
        samples_per_task=4,
        parallelism=parallelism,
        policy={"url": dead, "request_timeout_seconds": 5, "max_retries": 0},
        max_consecutive_infra_failures=limit,
    )
    count = len(tasks) * 4
    started = time.monotonic()
    report = batch.wait(240)
    assert report["status"] == "halted" and report["ok"] is False
    # Every episode is in the report once: the failures that tripped it, those in flight when
    # it tripped, and the rest aborted (never run) -- none of them a reward.
    assert sorted(row["index"] for row in report["pods"]) == list(range(count))
    assert report["reward_sum"] == 0 and report["successful_episodes"] == 0
    failed = [row for row in report["pods"] if row["status"] == "failed"]
    aborted = [row for row in report["pods"] if row["status"] == "lost"]
    assert all(row["failure_kind"] == "infrastructure" for row in failed)
    assert limit <= len(failed) <= limit + parallelism, len(failed)
    assert len(failed) + len(aborted) == count and len(aborted) >= count - limit - parallelism
    assert all("halted" in row["errors"][0] for row in aborted)
    halted = report["halted"]
    assert len(halted["failures"]) == limit
    assert f"{limit} infrastructure failures in a row" in halted["cause"]
    assert {f["index"] for f in halted["failures"]} <= {row["index"] for row in failed}
    # Halted, not run to the end: far sooner than count / parallelism rounds of failures.
    assert time.monotonic() - started < 120
    run_dir = Path(client.receipt(batch.batch_id)["run"]["run_dir"])
    assert sandbox_processes(run_dir) == [], "sandboxes survived the halt"

"""Real rollouts through the whole pipeline: real Redis, real Celery workers, the local backend
and the scripted policy; the trainer streams trajectories as episodes are collected."""

from __future__ import annotations

import pytest

from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.policy_server import running

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_a_trainer_streams_trajectories_and_gets_group_rewards(client):
    tasks = load_task_set("bundled", only=["fizzbuzz-order", "inventory-two-bugs", "palindrome"])
    with running(hangs=True, hang_seconds=4) as server:
        submission = client.submit(
            tasks=tasks,
            samples_per_task=2,
            policy={"url": server.url, "request_timeout_seconds": 2, "max_retries": 1},
        )
        seen = {}
        for row, trajectory in client.trajectories(submission.batch_id, timeout=180):
            seen[row["index"]] = (row, trajectory)
        report = client.wait(submission.batch_id, timeout=30)
    assert sorted(seen) == list(range(6))
    for index, (row, trajectory) in seen.items():
        episode = submission.spec.episode(index)
        assert (row["task_id"], row["sample"], row["group_id"]) == (
            episode.task_id,
            episode.sample,
            episode.group_id,
        )
        assert trajectory["episode_id"] == row["pod"]
        assert trajectory["group_id"] == episode.group_id
        if episode.task_id == "palindrome":
            assert row["status"] == "failed" and row["failure_kind"] == "infrastructure"
            assert trajectory["outcome"]["event"] == "error"
            continue
        assert row["status"] == "ok", row["errors"]
        steps = 6 if episode.task_id == "inventory-two-bugs" else 2
        assert len(trajectory["steps"]) == steps == row["steps"]
        want = 0 if (episode.task_id, episode.sample) == ("fizzbuzz-order", 1) else 1
        assert row["reward"] == want == trajectory["outcome"]["reward"]
    groups = {g["task_id"]: g for g in report["groups"]}
    assert groups["fizzbuzz-order"]["rewards"] == [1, 0]
    assert groups["inventory-two-bugs"]["pass_at_k"] == {"1": 1.0, "2": 1.0}
    assert groups["palindrome"]["status"] == "failed"
    assert report["infrastructure_failures"] == 2
    assert report["ok"] is False  # failures are reported, never hidden as rewards

"""A collector killed with SIGKILL mid-batch: its tasks come back, nothing is lost or doubled."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rollout_wire import constants as k
from rollout_worker.celery_app import COLLECT_LISTS, create_app
from rollout_worker.cli.stack import LocalStack
from rollout_worker.settings import Settings
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


# kombu's Redis transport keeps every delivered, not yet acknowledged message in this hash
# (delivery tag -> [message, exchange, routing key]) until it is acked or restored to its queue.
UNACKED = "unacked"


def _messages(raw_items) -> list[dict]:
    return [json.loads(raw) for raw in raw_items]


def unacked_collects(redis_client, batch_id: str) -> dict[str, str]:
    """delivery tag -> task id of this batch's unacknowledged collect messages."""
    held = {}
    for tag, raw in redis_client.hgetall(UNACKED).items():
        message = json.loads(raw)[0]
        headers = message["headers"]
        if headers["task"] == k.TASK_COLLECT and headers["id"].startswith(f"{batch_id}."):
            held[tag.decode()] = headers["id"]
    return held


def queued_collects(redis_client) -> dict[str, dict]:
    """task id -> message of the collect messages waiting in the queue."""
    raw = [item for name in COLLECT_LISTS for item in redis_client.lrange(name, 0, -1)]
    return {m["headers"]["id"]: m for m in _messages(raw)}


def test_killed_collector_loses_nothing_and_counts_nothing_twice():
    """The path claimed: a collector dies holding unacked collect messages; the transport
    restores them to the queue (flagged redelivered) after the visibility timeout; another
    collector runs them; the chord completes with every episode once."""
    env = {"ROLLOUT_VISIBILITY_TIMEOUT": "10", "ROLLOUT_COLLECT_BLOCK_SECONDS": "1"}
    # One collector at first, so every unacked collect message is provably the victim's.
    with LocalStack(collectors=1, collect_concurrency=4, extra_env=env) as stack:
        client = RolloutClient(stack.redis_url)
        submission = client.submit(count=40, parallelism=4)
        batch_id = submission.batch_id
        next(client.stream(batch_id, timeout=60))  # the batch is under way
        victim = next(w for w in stack.workers if w.name == "collect1")
        # Freeze it first: from now on it can neither ack, record nor retry what it holds. It is
        # killed only while it holds a task whose episode has no row yet (thawed and frozen
        # again a moment later until it does): that row can only come from the recovery.
        held, rows_before = freeze_holding_an_unrecorded_task(stack, victim, client, batch_id)
        stack.stop_worker(victim, sig=signal.SIGKILL)
        assert victim.proc.returncode == -signal.SIGKILL
        # Killed while holding them: none was acknowledged.
        assert set(held) <= set(unacked_collects(client.redis, batch_id)), held
        held_ids = set(held.values())

        # No collector is running now: the messages come back only through the transport's
        # restore (visibility timeout 10 s, swept every 10 s by the live control worker).
        restored: dict[str, dict] = {}
        deadline = time.monotonic() + 60
        while set(restored) != held_ids:
            assert time.monotonic() < deadline, (held_ids, set(restored))
            restored.update(
                (task_id, message)
                for task_id, message in queued_collects(client.redis).items()
                if task_id in held_ids
            )
            time.sleep(0.2)
        assert all(m["headers"].get("redelivered") is True for m in restored.values()), restored
        assert not set(held) & set(unacked_collects(client.redis, batch_id))

        # Another collector takes them over and the batch completes through the chord.
        rescuer = stack.start_worker(k.QUEUE_COLLECT, "collect2", pool="threads", concurrency=4)
        report = client.wait(batch_id, timeout=180)
        assert report["ok"] is True, report["errors"]
        # The chord completed: its callback ran. It may find the report written already: the
        # watchdog finalises a batch whose rows are all in when it looks, and one of its looks
        # can fall between the last row and the callback (a CI run under load saw it). The
        # rescuer's log below shows the rows came from the restored tasks, not the watchdog.
        assert_chord_callback_ran(client, batch_id)
        assert report["successful_episodes"] == 40 and report["reward_sum"] == 40
        assert sorted(row["index"] for row in report["pods"]) == list(range(40))
        assert len(client.redis.hkeys(k.episodes_key(batch_id))) == 40
        kinds = [d[b"type"] for _, d in client.redis.xrange(k.stream_key(batch_id))]
        assert kinds.count(b"episode") == 40
        # The rescuer's own log shows it received and finished each restored task.
        rescuer_log = rescuer.log.read_text()
        for task_id in held_ids:
            assert f"{k.TASK_COLLECT}[{task_id}] received" in rescuer_log, task_id
            assert f"{k.TASK_COLLECT}[{task_id}] succeeded" in rescuer_log, task_id
        # A held task whose row was already recorded (killed between recording and acking)
        # ran again on the rescuer as a no-op; the others recorded their rows there, the
        # episodes in flight at the kill among them.
        for task_id in held_ids:
            line = next(
                x for x in rescuer_log.splitlines() if f"{k.TASK_COLLECT}[{task_id}] succeeded" in x
            )
            if task_index(task_id) in rows_before:
                assert "'recorded': False" in line, line
            else:
                assert "'status': 'ok'" in line, line
        client.close()


def assert_chord_callback_ran(client, batch_id: str, timeout: float = 30) -> None:
    """The chord's callback ran and succeeded: its result is in the result backend (written by
    the worker that ran it), whoever wrote the report first."""
    key = f"celery-task-meta-{k.aggregate_task_id(batch_id)}"
    deadline = time.monotonic() + timeout
    while (raw := client.redis.get(key)) is None:
        assert time.monotonic() < deadline, f"the chord's callback never ran ({key})"
        time.sleep(0.2)
    assert json.loads(raw)["status"] == "SUCCESS", raw


def task_index(task_id: str) -> int:
    """The episode index of a collect task id (`<batch id>.<index>`)."""
    return int(task_id.rsplit(".", 1)[1])


def freeze_holding_an_unrecorded_task(stack, victim, client, batch_id, attempts=100):
    """SIGSTOP the collector at a moment it holds (unacknowledged) a collect task of an episode
    that has no row yet; returns (its unacked collect tasks, the rows recorded then). Between
    tries it runs for 0.1 s; fails if no moment qualifies."""
    seen = []
    for _ in range(attempts):
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        # Frozen, and the only collector: nothing records a row or acks a task until it dies.
        held = unacked_collects(client.redis, batch_id)
        rows = {int(i) for i in client.redis.hkeys(k.episodes_key(batch_id))}
        if any(task_index(t) not in rows for t in held.values()):
            return held, rows
        seen.append((sorted(held.values()), len(rows)))
        os.killpg(victim.proc.pid, signal.SIGCONT)
        time.sleep(0.1)
    stack.check_alive()
    raise AssertionError(f"the collector never held a task of an unrecorded episode: {seen[-5:]}")


def episodes_in_flight(run_dir: Path) -> set[int]:
    """Episodes the run's supervisor started (their log exists) and has not ended (no status
    file): what a supervisor that dies now leaves behind."""
    started = {int(p.stem) for p in (run_dir / "logs").glob("*.log") if p.stem.isdigit()}
    ended = {int(p.stem) for p in (run_dir / "status").glob("*.json") if p.stem.isdigit()}
    return started - ended


def test_a_killed_local_supervisor_is_revived_and_its_lost_episodes_reported():
    env = {"ROLLOUT_COLLECT_BLOCK_SECONDS": "1"}
    with LocalStack(collectors=1, extra_env=env) as stack:
        client = RolloutClient(stack.redis_url)
        submission = client.submit(count=30, parallelism=3)
        next(client.stream(submission.batch_id, timeout=60))
        run_dir = stack.dir / "runs" / submission.batch_id
        pid = int((run_dir / "supervisor.pid").read_text())
        # Killed while it runs episodes: frozen first (it can end none of them then), and
        # thawed and frozen again a moment later until some are in flight.
        for _ in range(100):
            os.kill(pid, signal.SIGSTOP)
            in_flight = episodes_in_flight(run_dir)
            if in_flight:
                break
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
        assert in_flight, "the supervisor never had an episode in flight to lose"
        os.kill(pid, signal.SIGKILL)
        report = client.wait(submission.batch_id, timeout=120)
        rows = report["pods"]
        assert sorted(row["index"] for row in rows) == list(range(30))
        # Exactly the episodes killed with the supervisor are failed, with why; never silently
        # rerun or dropped. The revived supervisor ran all the others.
        lost = {row["index"] for row in rows if row["status"] != "ok"}
        assert lost == in_flight, (lost, in_flight)
        for row in rows:
            if row["index"] in lost:
                assert "SupervisorLost" in " ".join(row["errors"]), row
        assert report["successful_episodes"] == report["reward_sum"] == 30 - len(lost)
        assert report["ok"] is False
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
        assert_chord_callback_ran(client, submission.batch_id)  # retried past Celery's default 3
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
        while sum(client.redis.llen(name) for name in COLLECT_LISTS) < 5:
            assert time.monotonic() < deadline, "the chord was never dispatched"
            time.sleep(0.1)
        client.redis.delete(*COLLECT_LISTS)  # the messages are gone for good
        report = client.wait(submission.batch_id, timeout=120)
        assert report["finalized_by"] == "watchdog"
        # The episodes themselves ran: the watchdog collects them instead of dropping them.
        assert report["ok"] is True, report["errors"]
        assert report["reward_sum"] == 5
        assert sorted(row["index"] for row in report["pods"]) == list(range(5))
        client.close()


def test_a_batchs_first_collect_messages_queue_behind_resent_ones():
    """Where the messages land in Redis decides who runs first: kombu BRPOPs a queue's lists
    in priority order. No collector runs, so the messages stay where they were put."""
    with LocalStack(collectors=1) as stack:
        stack.stop_worker(next(w for w in stack.workers if w.name == "collect1"))
        client = RolloutClient(stack.redis_url)
        client.submit(count=3, parallelism=3)
        deadline = time.monotonic() + 30
        while sum(client.redis.llen(name) for name in COLLECT_LISTS) < 3:
            assert time.monotonic() < deadline, "the chord was never dispatched"
            time.sleep(0.1)
        assert [client.redis.llen(name) for name in COLLECT_LISTS] == [0, 0, 0, 3]
        # A resent (woken) message goes to the list read first.
        app = create_app(Settings(redis_url=stack.redis_url), with_tasks=False)
        app.signature(
            k.TASK_COLLECT, args=("none", 0), queue=k.QUEUE_COLLECT, priority=k.PRIORITY_RESENT
        ).apply_async()
        assert client.redis.llen(COLLECT_LISTS[0]) == 1
        client.close()

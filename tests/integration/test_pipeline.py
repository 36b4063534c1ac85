"""End to end through real Redis and real Celery worker processes on the local backend."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from celery import Celery

from rollout_wire import constants as k
from rollout_wire.request import new_batch_id
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers]


def collect_counts(client: RolloutClient) -> dict[str, int]:
    stats = client.celery.control.inspect(timeout=5).stats() or {}
    return {node: data.get("total", {}).get(k.TASK_COLLECT, 0) for node, data in stats.items()}


def assert_exact(report, count):
    assert report["ok"] is True, report["errors"]
    assert report["episodes"] == count
    assert report["successful_episodes"] == count
    assert report["reward_sum"] == count
    assert [row["index"] for row in report["pods"]] == list(range(count))
    assert len({row["pod"] for row in report["pods"]}) == count


def test_a_100_episode_batch_is_collected_exactly_by_several_collectors(client):
    before = collect_counts(client)
    submission = client.submit(count=100, parallelism=20)
    early = next(client.stream(submission.batch_id, timeout=120))
    assert early["status"] == "ok"  # rewards arrive before the batch ends
    report = client.wait(submission.batch_id, timeout=180)
    assert_exact(report, 100)
    assert report["parallelism"] == 20
    assert report["batch_to_all_rewards_seconds"] >= report["batch_to_all_ready_seconds"] > 0
    assert 0 < report["pod_to_ready_p50_seconds"] <= report["pod_to_ready_p95_seconds"]
    assert report["finalized_by"] == "chord"
    after = collect_counts(client)
    collectors = [n for n in after if n.startswith("collect")]
    assert len(collectors) == 2
    assert all(after[n] > before.get(n, 0) for n in collectors), (before, after)
    # The stream holds each episode exactly once, then the report notice.
    entries = client.redis.xrange(k.stream_key(submission.batch_id))
    kinds = [data[b"type"].decode() for _, data in entries]
    assert kinds.count("episode") == 100 and kinds[-1] == "report"
    assert len(client.logs(submission.batch_id)) == 100


def _one_round(redis_url: str, round_no: int, queue) -> None:
    client = RolloutClient(redis_url)
    submission = client.submit(count=20, parallelism=5, labels={"round": str(round_no)})
    report = client.wait(submission.batch_id, timeout=240)
    queue.put((round_no, submission.batch_id, report))


def test_five_rounds_submitted_concurrently_from_separate_processes(stack):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_one_round, args=(stack.redis_url, n, queue)) for n in range(5)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert len({batch for _, batch, _ in results}) == 5
    pods = set()
    for round_no, batch_id, report in results:
        assert report["batch_id"] == batch_id
        assert report["labels"] == {"round": str(round_no)}
        assert_exact(report, 20)
        pods |= {row["pod"] for row in report["pods"]}
    assert len(pods) == 100  # no episode shared between rounds


def test_a_fix_that_does_not_fix_yields_a_failed_report_never_reward_1(client):
    submission = client.submit(count=5, parallelism=5, action="none")
    report = client.wait(submission.batch_id, timeout=120)
    assert report["ok"] is False and report["status"] == "failed"
    assert report["successful_episodes"] == 0 and report["failed_episodes"] == 5
    assert report["reward_sum"] == 0
    assert all(row["reward"] == 0 and row["tests_exit"] != 0 for row in report["pods"])
    assert any("tests_exit is 1" in e for e in report["errors"])


def test_a_hung_episode_is_reported_at_its_deadline(client):
    submission = client.submit(
        count=2, parallelism=2, action="hang", deadline_seconds=4, episode_timeout_seconds=2
    )
    report = client.wait(submission.batch_id, timeout=120)
    assert report["ok"] is False and report["reward_sum"] == 0
    assert all("DeadlineExceeded" in " ".join(row["errors"]) for row in report["pods"])


def _results_app(redis_url: str) -> Celery:
    """A client that can also read task results (the trainer's client only sends)."""
    app = Celery("rollout-test-results", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
    )
    return app


def finished_result(app: Celery, task_id: str, timeout: float) -> dict:
    """The return value of a task once it has run to the end (read from the result backend;
    no pub/sub subscription is left behind)."""
    deadline = time.monotonic() + timeout
    while True:
        meta = app.backend.get_task_meta(task_id)
        if meta["status"] == "SUCCESS":
            return meta["result"]
        assert meta["status"] in ("PENDING", "STARTED", "RETRY"), meta
        assert time.monotonic() < deadline, f"task {task_id} did not finish in {timeout}s: {meta}"
        time.sleep(0.1)


def test_redelivered_submit_and_collect_tasks_never_double_count(client):
    app = _results_app(client.redis_url)
    batch_id = new_batch_id()
    request = {"batch_id": batch_id, "count": 12, "parallelism": 4, "submitted_at": time.time()}
    submit = app.signature(k.TASK_SUBMIT, queue=k.QUEUE_CONTROL)
    # The same request delivered twice.
    submits = [submit.delay(request).id, submit.delay(request).id]
    deadline = time.monotonic() + 60
    while "run" not in client.receipt(batch_id):  # the run exists: copies now race the chord
        assert time.monotonic() < deadline, "the submit never started the run"
        time.sleep(0.05)
    # Re-sent collectors for every episode while the batch runs, under new task ids: Celery's
    # per-task-id dedupe cannot catch them; only our per-episode record can.
    copies = [
        app.signature(k.TASK_COLLECT, args=(batch_id, index), queue=k.QUEUE_COLLECT).delay().id
        for index in range(12)
    ]
    report = client.wait(batch_id, timeout=120)
    assert_exact(report, 12)
    # Both submits ran to the end (neither was dropped before doing anything).
    submitted = [finished_result(app, t, 60) for t in submits]
    assert all(s["batch_id"] == batch_id for s in submitted), submitted
    assert {s["status"] for s in submitted} <= {"started", "done"}, submitted
    # Every in-flight copy finished, each for its own episode, before we count.
    finished = [finished_result(app, t, 120) for t in copies]
    assert sorted(f["index"] for f in finished) == list(range(12)), finished
    assert not [f for f in finished if "error" in f], finished
    # Copies that arrived while their episode's first collector waited on it stood aside
    # (one collecting copy per episode), instead of watching and reading it a second time.
    assert int(client.redis.get(k.collect_copies_key(batch_id)) or 0) >= 1
    # Copies re-sent after the report: they run, find the row / the report, and do nothing.
    late_collect = app.signature(k.TASK_COLLECT, args=(batch_id, 3), queue=k.QUEUE_COLLECT)
    late_aggregate = app.signature(k.TASK_AGGREGATE, args=([], batch_id), queue=k.QUEUE_CONTROL)
    late = [late_collect.delay().id, late_aggregate.delay().id]
    assert finished_result(app, late[0], 60) == {"index": 3, "recorded": False}
    assert finished_result(app, late[1], 60)["status"] == "already-reported"
    app.close()
    # Only now, with every copy finished, count: one row and one stream entry per episode.
    assert len(client.redis.hkeys(k.episodes_key(batch_id))) == 12
    entries = client.redis.xrange(k.stream_key(batch_id))
    kinds = [data[b"type"].decode() for _, data in entries]
    assert kinds.count("episode") == 12 and kinds.count("report") == 1
    assert client.report(batch_id)["reported_at"] == report["reported_at"]
    assert client.receipt(batch_id)["run"]["run_uid"] == report["run"]["run_uid"]


def test_invalid_and_oversized_requests_get_a_rejection_report(client):
    submit = client.celery.signature(k.TASK_SUBMIT, queue=k.QUEUE_CONTROL)
    bad, big = new_batch_id(), new_batch_id()
    submit.delay({"batch_id": bad, "count": 0})
    submit.delay({"batch_id": big, "count": 301})  # the stack's maximum is 300
    reports = client.wait_many([bad, big], timeout=60)
    assert reports[bad]["status"] == "rejected"
    assert any("count must be at least 1" in e for e in reports[bad]["errors"])
    assert reports[big]["status"] == "rejected"
    assert any("configured maximum of 300" in e for e in reports[big]["errors"])
    assert not client.receipt(big)  # nothing was created for a refused batch

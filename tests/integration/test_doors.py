"""Bad input at every door, sent straight to the workers through the broker, and cancel.

Each malformed message gets a clear rejection and creates nothing: no receipt, no run folder,
and never a report under a batch id that another batch owns."""

from __future__ import annotations

import pickle
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery
from kombu import Connection, Exchange, Producer

from rollout_wire import constants as k
from rollout_wire.errors import InvalidSpec
from tests.integration.procs import sandbox_processes

pytestmark = [pytest.mark.redis, pytest.mark.workers]

OWNED = "owned-batch-1"

MALFORMED = [
    None,
    7,
    "count=10",
    [{"count": 1}],
    {"count": 0},
    {"count": -3},
    {"count": "10"},
    {"count": 1.5},
    {"count": True},
    {"count": 10**9},
    {"count": 5, "parallelism": 6},
    {"count": 5, "parallelism": "all"},
    {"count": 2, "backend": "ssh"},
    {"count": 2, "backend": ["local"]},
    {"count": 2, "image": "x" * 10_000},
    {"count": 2, "image": "UPPER:case"},
    {"count": 2, "runtime": "no_underscores"},
    {"count": 2, "deadline_seconds": 0},
    {"count": 2, "deadline_seconds": 10**12},
    {"count": 2, "deadline_seconds": 10, "episode_timeout_seconds": 20},
    {"count": 2, "resources": "lots"},
    {"count": 2, "resources": {"cpu_limit": {"nested": ["garbage"]}}},
    {"count": 2, "resources": {"gpu": "1"}},
    {"count": 2, "resources": {"memory_limit": "1Ki"}},
    {"count": 2, "resources": {"cpu_request": "2", "cpu_limit": "1"}},
    {"count": 2, "action": "rm -rf /"},
    {"count": 2, "labels": {"bad key!": "x"}},
    {"count": 2, "labels": ["not", "a", "map"]},
    {"count": 2, "tolerations": [{"evil": True}]},
    {"count": 2, "node_selector": {"a": 1}},
    {"count": 2, "keep_run": "yes"},
    {"count": 2, "submitted_at": "yesterday"},
    {"count": 2, "unknown_field": 1},
    {"count": 2, "batch_id": "UPPER CASE"},
    {"count": 2, "batch_id": "x" * 300},
    {"count": 2, "nested": {"a": {"b": {"c": [1, 2, {"d": None}]}}}},
    {"count": 2, "batch_id": OWNED, "image": "BAD"},  # a bad copy naming an owned batch
]


def submit_raw(stack, message, task_id):
    app = Celery(broker=stack.redis_url, set_as_current=False)
    app.conf.update(task_serializer="json")
    app.send_task(k.TASK_SUBMIT, args=(message,), queue=k.QUEUE_CONTROL, task_id=task_id)
    app.close()


def submit_answer(stack, task_id, timeout):
    """What `submit_batch` returned for the message sent as `task_id` (its Celery result):
    the proof that a worker took the message and handled it to the end."""
    app = Celery(backend=stack.redis_url, set_as_current=False)
    app.conf.update(result_serializer="json", result_accept_content=["json"])
    try:
        return app.AsyncResult(task_id).get(timeout=timeout)
    finally:
        app.close()


def runs_dir(stack) -> Path:
    return Path(stack.env["ROLLOUT_LOCAL_ROOT"])


def test_malformed_messages_through_the_broker_are_rejected_and_create_nothing(stack, client):
    owner = client.submit(batch_id=OWNED, count=1)
    owned_report = client.wait(OWNED, 120)
    assert owned_report["ok"] is True
    before = set(runs_dir(stack).iterdir()) if runs_dir(stack).exists() else set()
    messages = MALFORMED
    assert len(messages) >= 30
    ids = [f"door-{n}-{uuid.uuid4().hex[:8]}" for n in range(len(messages))]
    for message, task_id in zip(messages, ids, strict=True):
        submit_raw(stack, message, task_id)
    # Each message is answered under the id it would have had (its task id), except the copy
    # that names a batch which exists: that one must not touch the owner's report.
    answered = client.wait_many(ids[:-1], timeout=120)
    for task_id, message in zip(ids[:-1], messages[:-1], strict=True):
        report = answered[task_id]
        assert report["status"] == "rejected" and report["errors"], (message, report)
        assert client.receipt(task_id) == {}, message
    # The bad copy naming the owned batch was handled (the worker answered it: rejected, under
    # the owner's id) and the owner's report is the one it had, unchanged.
    bad_copy = submit_answer(stack, ids[-1], timeout=60)
    assert (bad_copy["batch_id"], bad_copy["status"]) == (OWNED, "rejected"), bad_copy
    assert any("image" in problem for problem in bad_copy["errors"]), bad_copy
    assert client.report(OWNED) == owned_report
    after = set(runs_dir(stack).iterdir()) if runs_dir(stack).exists() else set()
    assert after <= before, f"malformed messages created runs: {after - before}"
    assert owner.batch_id == OWNED


def test_the_client_refuses_bad_input_before_sending(client):
    with pytest.raises(InvalidSpec) as info:
        client.submit(count=0, image="BAD", resources={"cpu_limit": "lots"})
    assert len(info.value.problems) == 3


def test_a_pickled_message_is_refused_and_logged(stack, client):
    task_id = f"pickle-{uuid.uuid4().hex[:8]}"
    body = pickle.dumps(((), {"request": {"count": 1, "batch_id": task_id}}, {}))
    with Connection(stack.redis_url) as conn:
        producer = Producer(conn)
        producer.publish(
            body,
            routing_key=k.QUEUE_CONTROL,
            exchange=Exchange(k.QUEUE_CONTROL, type="direct"),
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"task": k.TASK_SUBMIT, "id": task_id, "lang": "py", "argsrepr": "()"},
        )
    control_log = next(w.log for w in stack.workers if w.queue == k.QUEUE_CONTROL)
    deadline = time.monotonic() + 30
    while "application/x-python-serialize" not in control_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the worker never logged the refused message"
        time.sleep(0.2)
    assert "ContentDisallowed" in control_log.read_text(errors="replace") or (
        "Refusing to deserialize" in control_log.read_text(errors="replace")
    )
    assert client.receipt(task_id) == {} and client.report(task_id) is None


#: A cancel is reported within this long; the batch's own deadline (HANG_DEADLINE_S from the
#: submit) is far beyond it, so a report in time was brought by the cancel, not the deadline.
CANCEL_REPORTED_WITHIN_S = 60
HANG_DEADLINE_S = 600


def test_cancel_stops_the_sandboxes_and_reports_what_had_finished(stack, client):
    batch = client.submit(count=6, parallelism=3, action="hang", deadline_seconds=HANG_DEADLINE_S)
    deadline = time.monotonic() + 60
    while not (client.receipt(batch.batch_id).get("run") or {}).get("run_dir"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    run_dir = Path(client.receipt(batch.batch_id)["run"]["run_dir"])
    while len(sandbox_processes(run_dir)) < 3:
        assert time.monotonic() < deadline, "the hanging episodes never started"
        time.sleep(0.1)
    batch.cancel()
    report = batch.wait(CANCEL_REPORTED_WITHIN_S)  # BatchTimeout past it: the cancel failed
    assert report["status"] == "cancelled" and report["ok"] is False
    assert report["lost_episodes"] == 6 and report["collected_episodes"] == 6
    assert all("cancelled" in row["errors"][0] for row in report["pods"])
    assert sandbox_processes(run_dir) == [], "sandboxes survived the cancel"

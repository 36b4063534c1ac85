"""Groups as they finish and the quota, end to end (real Redis, real workers, the local
backend's sandboxes, the scripted policy): one `group` entry per group, exactly once (also with
a killed collector and a redelivered callback); a quota that aborts the rest and leaves no
sandbox behind, with nothing aborted counted as a failure or a reward."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from rollout_wire import constants as k
from rollout_wire.codec import decode_entry
from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.policy_server import bundled_script, running
from rollout_worker.cli.stack import LocalStack
from tests.integration.procs import sandbox_processes
from tests.integration.test_pipeline import _results_app, finished_result
from tests.integration.test_worker_loss import freeze_holding_an_unrecorded_task
from trainer_stub.client import RolloutClient
from trainer_stub.sampling import ContinuousSampler

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

SLOW_TASKS = ("clamp-range", "inventory-two-bugs")
SLOW_SECONDS = 90.0


def stream_entries(client: RolloutClient, batch_id: str) -> list:
    return [decode_entry(d) for _, d in client.redis.xrange(k.stream_key(batch_id))]


def assert_each_group_once_after_its_rows(client: RolloutClient, batch_id: str, groups: int):
    entries = stream_entries(client, batch_id)
    seen = [e.group["group_id"] for e in entries if e.type == k.ENTRY_GROUP]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == groups, seen
    rows_before: set[int] = set()
    for entry in entries:
        if entry.type == k.ENTRY_EPISODE:
            rows_before.add(entry.index)
        elif entry.type == k.ENTRY_GROUP:
            assert set(entry.group["indexes"]) <= rows_before, entry.group["group_id"]
    assert entries[-1].type == k.ENTRY_REPORT  # every group entry comes before the report
    return [e.group for e in entries if e.type == k.ENTRY_GROUP]


def test_a_quota_reports_once_its_groups_are_in_and_aborts_the_slow_rest(client):
    script = bundled_script()
    for task_id in SLOW_TASKS:  # these groups' samples answer long after the others
        script["tasks"][task_id] = {
            "plans": [[{"tool": "submit", "arguments": {}, "delay": SLOW_SECONDS}]]
        }
    tasks = load_task_set("bundled")
    fast = {f"{t['id']}" for t in tasks} - set(SLOW_TASKS)
    with running(script=script) as server:
        started = time.monotonic()
        batch = client.submit(
            tasks=tasks,
            samples_per_task=2,
            policy={"url": server.url, "request_timeout_seconds": 120, "max_retries": 0},
            groups_wanted=len(fast),
        )
        streamed = list(client.groups(batch.batch_id, timeout=120))
        report = client.wait(batch.batch_id, timeout=30)
        took = time.monotonic() - started
    assert report["status"] == "succeeded" and report["ok"] is True, report["errors"]
    assert took < SLOW_SECONDS / 2, f"the report waited for the slow samples: {took:.1f}s"
    quota = report["quota"]
    assert quota["met"] and {g.split(":")[1] for g in quota["counted"]} == fast
    assert {g.split(":")[1] for g in quota["cut"]} == set(SLOW_TASKS)
    aborted = [r for r in report["pods"] if r["status"] == "aborted"]
    assert {r["task_id"] for r in aborted} == set(SLOW_TASKS) and len(aborted) == 4
    assert all(r["failure_kind"] is None and r["reward"] == 0 for r in aborted)
    assert report["aborted_episodes"] == 4 and report["failed_episodes"] == 0
    assert report["lost_episodes"] == 0 and report["infrastructure_failures"] == 0
    assert report["reward_sum"] == sum(r["reward"] for r in report["pods"] if r["status"] == "ok")
    # The slow samples had run a few seconds of their 120 s timeout when they were cut.
    assert 0 <= quota["saved_sandbox_seconds_at_least"] < quota["saved_sandbox_seconds_at_most"]
    assert quota["saved_sandbox_seconds_at_most"] > 4 * 60
    # The stream had every group once, the counted ones flagged, before the report.
    groups = assert_each_group_once_after_its_rows(client, batch.batch_id, len(tasks))
    assert [g["group_id"] for g in streamed] == [g["group_id"] for g in groups]
    assert {g["group_id"] for g in groups if g["counted"]} == set(quota["counted"])
    cut = [g for g in groups if g["group_id"] in quota["cut"]]
    assert all(g["status"] == "aborted" and g["rewards"] == [] for g in cut)
    run_dir = Path(client.receipt(batch.batch_id)["run"]["run_dir"])
    assert sandbox_processes(run_dir) == [], "sandboxes survived the quota's abort"


def test_group_entries_are_streamed_exactly_once_with_a_killed_collector_and_a_late_callback():
    """A collector SIGKILLed while it holds an episode of a group without its row: the message
    comes back (visibility timeout), another collector records the row and streams the group;
    a callback sent again after the report streams nothing twice."""
    env = {"ROLLOUT_VISIBILITY_TIMEOUT": "10", "ROLLOUT_COLLECT_BLOCK_SECONDS": "1"}
    tasks = load_task_set("bundled")
    with (
        running(turn_seconds=0.3) as server,
        LocalStack(collectors=1, collect_concurrency=4, extra_env=env) as stack,
    ):
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        batch = client.submit(
            tasks=tasks, samples_per_task=4, parallelism=12, policy={"url": server.url}
        )
        next(client.stream(batch.batch_id, timeout=90))  # under way
        victim = next(w for w in stack.workers if w.name == "collect1")
        freeze_holding_an_unrecorded_task(stack, victim, client, batch.batch_id)
        stack.stop_worker(victim, sig=signal.SIGKILL)
        stack.start_worker(k.QUEUE_COLLECT, "collect2", pool="threads", concurrency=4)
        report = client.wait(batch.batch_id, timeout=240)
        assert report["ok"] is True, report["errors"]
        app = _results_app(stack.redis_url)
        late = app.signature(k.TASK_AGGREGATE, args=([], batch.batch_id), queue=k.QUEUE_CONTROL)
        late_collect = app.signature(
            k.TASK_COLLECT, args=(batch.batch_id, 5), queue=k.QUEUE_COLLECT
        )
        assert finished_result(app, late.delay().id, 60)["status"] == "already-reported"
        assert finished_result(app, late_collect.delay().id, 60)["recorded"] is False
        app.close()
        groups = assert_each_group_once_after_its_rows(client, batch.batch_id, len(tasks))
        by_id = {g["group_id"]: g for g in report["groups"]}
        for group in groups:  # the streamed figures are the report's
            expected = by_id[group["group_id"]]
            assert group["rewards"] == expected["rewards"] and group["status"] == expected["status"]
        client.close()


FAST_TASKS = ["shipping-boundary", "fizzbuzz-order", "leap-year"]


def test_continuous_sampling_gives_complete_groups_and_cancels_what_is_left_when_closed(client):
    tasks = load_task_set("bundled", FAST_TASKS)
    with running(turn_seconds=0.2) as server:
        sampler = ContinuousSampler(
            client,
            tasks,
            2,
            groups_in_flight=3,
            total_groups=5,
            request={"policy": {"url": server.url}},
        )
        groups = list(sampler.groups(timeout=180))
        assert len(groups) == 5 and all(g["status"] == "complete" for g in groups)
        assert len({g["group_id"] for g in groups}) == 5
        # More than one batch: groups were topped up as others completed.
        assert sampler.batches >= 2
        # An early close (a trainer that has enough) cancels what is still running.
        early = ContinuousSampler(
            client, tasks, 2, groups_in_flight=3, request={"policy": {"url": server.url}}
        )
        iterator = early.groups(timeout=180)
        next(iterator)
        running_batches = early.following.waiting()
        iterator.close()
    for batch_id in set(sampler.following.names.values()) | set(early.following.names.values()):
        report = client.wait(batch_id, timeout=120)
        assert report["status"] in ("succeeded", "cancelled"), (batch_id, report["errors"])
        if batch_id in running_batches:
            assert report["status"] == "cancelled" or report["ok"], report["errors"]
        run_dir = Path(client.receipt(batch_id)["run"]["run_dir"])
        assert sandbox_processes(run_dir) == [], f"{batch_id} left sandboxes behind"


def test_an_episode_whose_policy_moved_on_past_the_bound_is_stopped_stale(client):
    """The runner sees the policy's version on every turn: once it is more than
    `max_policy_lag` ahead of the first turn's, the episode stops there, recorded `stale`."""
    tasks = load_task_set("bundled", ["stack-pop"])
    script = bundled_script()
    write, submit = script["tasks"]["stack-pop"]["plans"][0]
    # The second turn is answered 5 s after it is asked: the version moves on in between, for
    # both samples, however far apart they run.
    script["tasks"]["stack-pop"] = {"plans": [[write | {"delay": 0}, submit | {"delay": 5}]]}
    with running(script=script) as server:
        batch = client.submit(
            tasks=tasks, samples_per_task=2, policy={"url": server.url, "max_policy_lag": 1}
        )
        deadline = time.monotonic() + 60
        while sum(c["turn"] == 1 for c in server.calls()) < 2:  # both asked their 2nd turn
            assert time.monotonic() < deadline, server.calls()
            time.sleep(0.05)
        server.set_version(3)  # the trainer updated the weights during the second turn
        report = client.wait(batch.batch_id, timeout=120)
    rows = report["pods"]
    assert [r["status"] for r in rows] == ["stale", "stale"], [r["failure_cause"] for r in rows]
    assert all(r["policy_versions"] == {"first": "0", "last": "0"} for r in rows)
    assert all("policy at 3" in r["failure_cause"] for r in rows), rows[0]["failure_cause"]
    assert report["stale_episodes"] == 2 and report["reward_sum"] == 0
    assert report["failed_episodes"] == 0 and report["ok"] is True
    assert report["groups"][0]["status"] == "aborted"


def test_a_sample_recorded_after_its_trainer_moved_on_past_the_bound_is_stale(client):
    """The trainer publishes its version through the client; a row whose first turn is more
    than `max_policy_lag` behind it when it is recorded is stale, whatever the server said."""
    trainer = f"t{time.monotonic_ns()}"
    client.publish_policy_version(10, trainer=trainer)
    tasks = load_task_set("bundled", ["shipping-boundary"])
    with running() as server:  # still serving version 0
        batch = client.submit(
            tasks=tasks,
            samples_per_task=2,
            policy={"url": server.url, "max_policy_lag": 2, "trainer": trainer},
        )
        report = client.wait(batch.batch_id, timeout=120)
    assert report["policy_version"] == "10"  # what the batch was submitted under
    assert [r["status"] for r in report["pods"]] == ["stale", "stale"]
    assert "the trainer is at 10" in report["pods"][0]["failure_cause"]
    assert report["reward_sum"] == 0 and report["stale_episodes"] == 2

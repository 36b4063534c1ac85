"""The retry budget (`infra_retries`): an episode whose runner failed for infrastructure reasons
runs again in a fresh sandbox, at most that many times; its row keeps the earlier attempts, and
a group left with an infrastructure failure is failed as a whole.

The scripted policy answers HTTP 503 to the attempts a turn names (`unavailable_on_attempts`),
so what is retried, and what each attempt then earns, comes from what really ran.
"""

from __future__ import annotations

import copy
import time

import pytest

from rollout_wire.request import parse_spec
from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.local.backend import LocalBackend
from rollout_worker.cli.policy_server import bundled_script, running
from rollout_worker.report import build_report
from rollout_worker.settings import Settings
from rollout_worker.validation import validate_episode
from trainer_stub.client import RolloutClient

TASKS = ["shipping-boundary", "fizzbuzz-order"]
# No retries inside the runner: one 503 is an infrastructure failure of the attempt.
POLICY = {"model": "scripted", "request_timeout_seconds": 10, "max_retries": 0}


def outage_script() -> dict:
    """shipping-boundary sample 0: down for attempt 0 only (the retry earns the reward);
    fizzbuzz-order sample 0: down for attempts 0 and 1 (a budget of 1 is spent). Samples 1
    follow the bundled plans (shipping: right fix; fizzbuzz: a wrong fix, reward 0)."""
    script = copy.deepcopy(bundled_script())
    for task_id, down in (("shipping-boundary", [0]), ("fizzbuzz-order", [0, 1])):
        plans = script["tasks"][task_id]["plans"]
        right = plans[0]
        second = plans[1] if len(plans) > 1 else right
        first = [{**right[0], "unavailable_on_attempts": down}, *right[1:]]
        script["tasks"][task_id]["plans"] = [first, second]
    return script


def check_rows(rows_by_index, spec, calls):
    """What the outages must produce, whichever backend ran them."""
    by_task = {
        (spec.episode(i).task_id, spec.episode(i).sample): r for i, r in rows_by_index.items()
    }
    shipped, shipped_fine = by_task["shipping-boundary", 0], by_task["shipping-boundary", 1]
    assert shipped["status"] == "ok" and shipped["reward"] == 1, shipped["errors"]
    assert len(shipped["retried"]) == 1
    first = shipped["retried"][0]
    assert first["exit_code"] == 4 and "503" in (first["cause"] or ""), first
    assert first["episode_id"] != shipped["pod"]  # a fresh sandbox
    assert shipped_fine["retried"] == [] and shipped_fine["reward"] == 1

    spent, wrong = by_task["fizzbuzz-order", 0], by_task["fizzbuzz-order", 1]
    assert spent["status"] == "failed" and spent["failure_kind"] == "infrastructure", spent
    assert spent["reward"] == 0 and len(spent["retried"]) == 1
    assert wrong["status"] == "ok" and wrong["reward"] == 0 and wrong["retried"] == []

    # The policy saw each attempt under its own episode id, with the attempt number and the
    # group of its task.
    seen = {(c["episode_id"], c["attempt"], c["group_id"]) for c in calls}
    assert (first["episode_id"], 0, shipped["group_id"]) in seen
    assert (shipped["pod"], 1, shipped["group_id"]) in seen
    assert {c["attempt"] for c in calls if c["episode_id"] == spent["pod"]} == {1}


def check_groups(report):
    groups = {g["task_id"]: g for g in report["groups"]}
    assert groups["shipping-boundary"]["status"] == "complete"
    assert groups["shipping-boundary"]["rewards"] == [1, 1]
    assert groups["shipping-boundary"]["retries"] == 1
    assert groups["fizzbuzz-order"]["status"] == "failed"
    assert groups["fizzbuzz-order"]["rewards"] == [0]
    assert (report["retried_episodes"], report["retries"], report["infra_retries"]) == (2, 2, 1)


@pytest.mark.slow
def test_local_retries_an_infrastructure_failure_in_a_fresh_sandbox(open_tmp_path):
    backend = LocalBackend(
        Settings(local_root=open_tmp_path / "runs", redis_url="redis://127.0.0.1:9/0")
    )
    with running(script=outage_script()) as server:
        spec = parse_spec(
            {
                "tasks": load_task_set("bundled", only=TASKS),
                "samples_per_task": 2,
                "policy": POLICY | {"url": server.url},
                "infra_retries": 1,
            },
            max_episodes=100,
        )
        handle = backend.start_run(spec, lambda fields: None)
        rows = {}
        for index in range(spec.count):
            obs = backend.wait_episode(handle, index, 120)
            assert obs.terminal, obs
            rows[index] = validate_episode(obs, backend.read_output(handle, obs), handle.origin)
        finished = backend.finish_run(spec, handle)
        calls = server.calls()
    backend.delete_run(handle)
    check_rows({i: r.to_dict() for i, r in rows.items()}, spec, calls)
    report = build_report(
        spec, list(rows.values()), handle, finished, finalized_by="test", reported_at=time.time()
    )
    check_groups(report)
    # The failed attempts' logs are records of the run, with the runner's error in them.
    attempt_logs = {name: text for name, text in finished.records.items() if ".attempt" in name}
    assert sorted(attempt_logs) == ["episode-0.attempt0.log", "episode-2.attempt0.log"]
    assert all('"event": "error"' in text for text in attempt_logs.values())


@pytest.mark.k8s
@pytest.mark.k8s_real
@pytest.mark.redis
@pytest.mark.workers
def test_the_job_controller_retries_an_infrastructure_failure_in_a_new_pod(
    real_node, real_stack, k8s_cluster
):
    node = k8s_cluster.core.read_node(real_node.name)
    host = next(a.address for a in node.status.addresses if a.type == "InternalIP")
    client = RolloutClient(real_stack.redis_url)
    with running(host="0.0.0.0", script=outage_script()) as server:
        submission = client.submit(
            **real_node.batch_fields()
            | {
                "backend": "kubernetes",
                "tasks": load_task_set("bundled", only=TASKS),
                "samples_per_task": 2,
                "policy": POLICY | {"url": f"http://{host}:{server.port}"},
                "infra_retries": 1,
                "capacity_check": "warn",
            }
        )
        report = client.wait(submission.batch_id, timeout=600)
        calls = server.calls()
    rows = {row["index"]: row for row in report["pods"]}
    assert sorted(rows) == [0, 1, 2, 3], report["errors"]
    check_rows(rows, submission.spec, calls)
    check_groups(report)
    assert all(rows[i]["restart_count"] == 0 for i in rows)

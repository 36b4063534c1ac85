"""The kubernetes backend against a real API server (the local cluster, KWOK nodes).

Pods on KWOK nodes never run a container: for each batch Pod the harness
(tests/integration/kwok_episodes.py) runs the Pod's own episode program in the local sandbox
and serves that run's output, exit code and termination message as the Pod's, so every reward
here was computed by a real episode run. Everything else is real: the API server, the Job
controller, the scheduler, Redis and the Celery workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from kubernetes.client.rest import ApiException

from rollout_wire.errors import OwnershipError
from rollout_wire.request import parse_spec
from rollout_worker.backends.kube.backend import KubernetesBackend
from rollout_worker.backends.kube.objects import namespace_name
from rollout_worker.settings import Settings
from tests.integration.guide import GUIDE_FIELDS, GUIDE_ROW_FIELDS
from tests.integration.kwok_episodes import (  # noqa: F401 - fixtures
    FATES,
    Mix,
    classification_problems,
    describe_mix,
    describe_timing,
    episodes_fixture,
    kube_stack_fixture,
    kwok_request,
    kwok_runtime_fixture,
    new_batch_id,
)
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.redis, pytest.mark.workers]


def assert_from_real_runs(report, episodes):
    """Each row's reward and timestamps are those its Pod's real episode run printed."""
    served = episodes.served_in(report["run"]["namespace"])
    runs = {s.pod: s.run for s in served.values()}
    for row in report["pods"]:
        run = runs.get(row["pod"])
        assert run is not None, f"{row['pod']} was not run by the harness"
        reward = [e for e in run.events() if e.get("event") == "reward"]
        assert len(reward) == 1 and reward[0]["episode_id"] == row["pod"], run.entries
        assert row["reward"] == reward[0]["reward"] and row["reward_at"] == reward[0]["at"]
        assert row["exit_code"] == run.exit_code


def namespace_exists(cluster, name) -> bool:
    try:
        cluster.core.read_namespace(name)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the report may take its whole 900 s wait, then 120 s of records
def test_one_batch_of_1000_episodes_is_reported_exactly(
    kube_stack, kwok_runtime, episodes, k8s_cluster
):
    """1000 episodes whose fates are drawn from a seeded mix (kwok_episodes.FATES: success,
    reward 0, non-zero exit, DeadlineExceeded, deleted mid-run, forged episode id, two
    rewards, a non-JSON line, an empty log): every row is classified exactly as drawn."""
    rollout = RolloutClient(kube_stack.redis_url)
    count, mix = 1000, Mix(20261130)
    fates = mix.fates(count)
    assert set(fates) == set(FATES)
    batch_id = episodes.use_mix(new_batch_id(), mix)
    t0 = time.monotonic()
    rollout.submit(batch_id=batch_id, count=count, parallelism=200, **kwok_request(kwok_runtime))
    report = rollout.wait(batch_id, timeout=900)
    print("\n" + describe_mix(report, fates, time.monotonic() - t0))
    problems = classification_problems(report, fates)
    assert not problems, "\n".join(problems)
    assert all(row["node"].startswith(kc.KWOK_NODE_PREFIX) for row in report["pods"])
    assert report["phases"]["scheduling"]["n"] == count
    # The report comes first; the records follow once the Job settled. Some episodes failed,
    # so the Job ended Failed (FailedIndexes), not Complete.
    reported = time.monotonic()
    deadline = reported + 120
    while rollout.receipt(batch_id).get("records") != "complete":
        assert time.monotonic() < deadline, rollout.receipt(batch_id).get("records")
        time.sleep(0.5)
    # Never Complete with failed episodes. The verdict is the Job's as recorded (job.json, read
    # once its controller marked it, or after the records' bounded settle wait): "Failed" when
    # the Job carries its Failed condition, "Running" only when it carries neither (1000 Pods
    # on 2 cores: the controller may not have marked it yet).
    job = json.loads(rollout.records(batch_id)["job.json"])
    conditions = job["status"].get("conditions") or []
    marked = {c["type"] for c in conditions if c["status"] == "True"}
    assert "Complete" not in marked, job["status"]
    expected = "Failed" if "Failed" in marked else "Running"
    assert rollout.receipt(batch_id)["run_verdict"] == expected, job["status"]
    # The run was deleted after its report (keep_run is off by default for the trainer).
    while namespace_exists(k8s_cluster, namespace_name(batch_id)):
        assert time.monotonic() < deadline, "namespace still there 120 s after the report"
        time.sleep(1)
    print(f"report -> namespace gone: {time.monotonic() - reported:.1f}s")
    rollout.close()


PER_ROUND = 40


@pytest.mark.slow
@pytest.mark.timeout(600)  # the reports may take their whole 400 s wait
def test_ten_concurrent_batches_of_40(kube_stack, kwok_runtime, episodes):
    """Ten rounds at once, each with its own seeded mix of fates: each report holds exactly
    its own batch's outcomes, classified as drawn. (40 each: the size of one batch is
    test_one_batch_of_1000_episodes_is_reported_exactly's concern; 100 each took 2 min.)"""
    rollout = RolloutClient(kube_stack.redis_url)
    mixes = [Mix(1000 + n) for n in range(10)]
    batch_ids = [episodes.use_mix(new_batch_id(), mix) for mix in mixes]
    t0, submitted_at = time.monotonic(), time.time()
    for n, batch_id in enumerate(batch_ids):
        rollout.submit(
            batch_id=batch_id,
            count=PER_ROUND,
            parallelism=20,
            # The rounds take 27-94 s (CI and alone). The deadline bounds what an ended
            # episode its collectors missed costs: it is collected when its batch gives up
            # (deadline + 30 s grace), so with 600 s one CI run took 632 s, all rows right.
            deadline_seconds=240,
            labels={"round": str(n)},
            **kwok_request(kwok_runtime),
        )
    reports = rollout.wait_many(batch_ids, timeout=400)
    elapsed = time.monotonic() - t0
    pods, problems = set(), []
    for n, batch_id in enumerate(batch_ids):
        report, fates = reports[batch_id], mixes[n].fates(PER_ROUND)
        print(f"\nround {n}: " + describe_mix(report, fates, elapsed))
        print(f"round {n} timing: " + describe_timing(report, fates, submitted_at))
        assert report["labels"] == {"round": str(n)}
        problems += [f"round {n}: {p}" for p in classification_problems(report, fates)]
        pods |= {(report["run"]["namespace"], row["pod"]) for row in report["pods"]}
    assert not problems, "\n".join(problems)
    assert len(pods) == 10 * PER_ROUND
    rollout.close()


def test_preflight_refuses_before_any_mutation(kube_stack, kwok_runtime, k8s_cluster):
    rollout = RolloutClient(kube_stack.redis_url)
    missing = rollout.submit(count=2, **kwok_request("no-such-runtime"))
    too_big = rollout.submit(
        count=10,
        parallelism=10,
        resources={"memory_request": "3Ti", "memory_limit": "3Ti"},
        **kwok_request(kwok_runtime),
    )
    reports = rollout.wait_many([missing.batch_id, too_big.batch_id], timeout=120)
    assert reports[missing.batch_id]["status"] == "error"
    assert "RuntimeClass 'no-such-runtime' does not exist" in reports[missing.batch_id]["errors"][0]
    text = reports[too_big.batch_id]["errors"][0]
    assert reports[too_big.batch_id]["status"] == "error"
    # The arithmetic: per-sandbox request + RuntimeClass overhead, and what each node fits.
    assert "3Ti + overhead 64Mi" in text and "room for" in text and "of 10 sandboxes" in text
    for submission in (missing, too_big):
        assert not namespace_exists(k8s_cluster, namespace_name(submission.batch_id))
    rollout.close()


def test_creation_is_idempotent_and_refuses_objects_that_are_not_ours(k8s_cluster, kwok_runtime):
    backend = KubernetesBackend(Settings(kubeconfig=str(k8s_cluster.kubeconfig)))
    spec = parse_spec({"count": 2, **kwok_request(kwok_runtime)}, max_episodes=10)
    receipt: dict = {}
    first = backend.start_run(spec, receipt.update)
    again = backend.start_run(spec, receipt.update)  # a redelivered submit_batch
    assert again == first and receipt["uid"] == first.namespace_uid
    assert receipt["job_uid"] == first.job_uid
    deadline = time.monotonic() + 120
    while not backend.delete_run(first):  # deletion runs in Kubernetes; look again
        assert time.monotonic() < deadline, "namespace still terminating after 120 s"
        time.sleep(0.5)
    assert not namespace_exists(k8s_cluster, first.namespace)

    squatter = parse_spec({"count": 2, **kwok_request(kwok_runtime)}, max_episodes=10)
    k8s_cluster.core.create_namespace({"metadata": {"name": namespace_name(squatter.batch_id)}})
    try:
        with pytest.raises(OwnershipError, match="not ours"):
            backend.start_run(squatter, lambda _: None)
    finally:
        k8s_cluster.core.delete_namespace(namespace_name(squatter.batch_id))


def rollout_cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "rollout_worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def test_guide_drop_in_records_and_cleanup_refusing_a_decoy(
    kube_stack, kwok_runtime, episodes, k8s_cluster, tmp_path
):
    env = {"ROLLOUT_REDIS_URL": kube_stack.redis_url, "KUBECONFIG": str(k8s_cluster.kubeconfig)}
    placement = ["--node-selector", "type=kwok", "--toleration", f"{kc.KWOK_TAINT_KEY}:NoSchedule"]
    out = tmp_path / "rl-parallel-3"
    done = rollout_cli(
        "run",
        "--backend",
        "kubernetes",
        "--count",
        "3",
        "--runtime",
        kwok_runtime,
        "--output",
        str(out),
        *placement,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(GUIDE_FIELDS) <= set(results), set(GUIDE_FIELDS) - set(results)
    assert (results["episodes"], results["successful_episodes"], results["reward_sum"]) == (3, 3, 3)
    assert_from_real_runs(results | {"run": {"namespace": results["namespace"]}}, episodes)
    for row in results["pods"]:
        assert set(GUIDE_ROW_FIELDS) <= set(row)
        assert (out / f"{row['pod']}.log").exists()
    for name in ("job.json", "pods.json", "events.txt", "receipt.json", "job-submitted.json"):
        assert (out / name).exists(), name
    receipt = json.loads((out / "receipt.json").read_text())
    assert {"context", "namespace", "run_id", "uid", "job_uid"} <= set(receipt)
    namespace = receipt["namespace"]
    assert namespace_exists(k8s_cluster, namespace)  # kept for `rollout cleanup`

    # A decoy: same name, same labels, but not the namespace we created.
    labels = k8s_cluster.core.read_namespace(namespace).metadata.labels
    k8s_cluster.core.delete_namespace(namespace)
    deadline = time.monotonic() + 120
    while namespace_exists(k8s_cluster, namespace):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    k8s_cluster.core.create_namespace({"metadata": {"name": namespace, "labels": labels}})
    refused = rollout_cli("cleanup", "--output", str(out), env=env)
    assert refused.returncode != 0 and "refusing" in refused.stderr
    assert namespace_exists(k8s_cluster, namespace)
    k8s_cluster.core.delete_namespace(namespace)

    # A real kept run is deleted by cleanup.
    out2 = tmp_path / "rl-parallel-2"
    done = rollout_cli(
        "run",
        "--backend",
        "kubernetes",
        "--count",
        "2",
        "--runtime",
        kwok_runtime,
        "--output",
        str(out2),
        *placement,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    namespace2 = json.loads((out2 / "receipt.json").read_text())["namespace"]
    cleaned = rollout_cli("cleanup", "--output", str(out2), env=env)
    assert cleaned.returncode == 0, cleaned.stderr
    assert not namespace_exists(k8s_cluster, namespace2)


def test_check_reports_cluster_and_runtime_class(kube_stack, kwok_runtime, k8s_cluster):
    env = {"ROLLOUT_REDIS_URL": kube_stack.redis_url, "KUBECONFIG": str(k8s_cluster.kubeconfig)}
    good = rollout_cli("check", "--runtime", kwok_runtime, env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"RuntimeClass {kwok_runtime}: handler kwok" in good.stdout
    assert "queue collect: 2 worker" in good.stdout
    bad = rollout_cli("check", "--runtime", "no-such-runtime", env=env)
    assert bad.returncode == 1 and "'no-such-runtime' does not exist" in bad.stderr

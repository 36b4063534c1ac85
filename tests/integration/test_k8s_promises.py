"""Issue 13's promises on Kubernetes, through the real API server, with Pods on the real node:
cleanup through the context recorded in the receipt, the receipt in --output from before the
first mutation on (the CLI killed mid-run), cancel, and the sweeper."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from kubernetes.client.rest import ApiException

from rollout_wire import constants as k
from rollout_worker.backends.kube.objects import JOB_NAME
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

GONE_WITHIN_SECONDS = 120
CLI = [sys.executable, "-m", "rollout_worker.cli"]


# -- helpers ---------------------------------------------------------------------------------
def real_node_flags(real_node) -> list[str]:
    return real_node.run_flags()


def cli_env(kubeconfig: Path | str, redis_url: str | None = None) -> dict[str, str]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "COLUMNS": "240"}
    env.pop("ROLLOUT_KUBE_CONTEXT", None)
    if redis_url is not None:
        env["ROLLOUT_REDIS_URL"] = redis_url
    else:
        env.pop("ROLLOUT_REDIS_URL", None)
    return env


def rollout(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def batch_namespaces(cluster, batch_id: str) -> list[dict[str, Any]]:
    found = cluster.core.list_namespace(label_selector=f"{k.LABEL_BATCH}={batch_id}")
    return [
        {
            "name": ns.metadata.name,
            "uid": ns.metadata.uid,
            "deleting": ns.metadata.deletion_timestamp is not None,
        }
        for ns in found.items
    ]


def wait_for(what: str, check, timeout: float, step: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(step)


def wait_gone(cluster, batch_id: str, timeout: float = GONE_WITHIN_SECONDS) -> float:
    start = time.monotonic()
    wait_for(
        f"namespace of batch {batch_id} gone",
        lambda: not batch_namespaces(cluster, batch_id),
        timeout,
    )
    return time.monotonic() - start


def read_receipt_file(output: Path) -> dict[str, Any]:
    try:
        return json.loads((output / "receipt.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def running_pods(cluster, namespace: str) -> list[str]:
    pods = cluster.core.list_namespaced_pod(namespace).items
    return [p.metadata.name for p in pods if p.status.phase == "Running"]


def forget_batch(redis_url: str, batch_id: str) -> None:
    """Drop a test batch from the stack's run registry (the sweeper of later tests then never
    looks at it)."""
    r = redis.Redis.from_url(redis_url)
    try:
        r.hdel(k.RUNS_KEY, batch_id)
    finally:
        r.close()


def registered(redis_url: str, batch_id: str) -> bool:
    """Whether the stack's run registry (what the sweeper looks at) still holds the batch."""
    r = redis.Redis.from_url(redis_url)
    try:
        return bool(r.hexists(k.RUNS_KEY, batch_id))
    finally:
        r.close()


class NotFoundApi(http.server.BaseHTTPRequestHandler):
    """Another "cluster": an API server that has nothing (404 to every request). A cleanup that
    asked it would conclude the namespace was already gone."""

    requests: list[str] = []

    def _answer(self) -> None:
        type(self).requests.append(f"{self.command} {self.path}")
        body = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
                "message": "not found",
            }
        ).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_DELETE = do_PATCH = do_POST = do_PUT = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def elsewhere_api() -> Iterator[str]:
    NotFoundApi.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFoundApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# -- 1. cleanup through the recorded context -------------------------------------------------
def test_cleanup_uses_the_context_recorded_in_the_receipt_not_the_current_one(
    real_node, real_stack, k8s_cluster, tmp_path, elsewhere_api
):
    config = yaml.safe_load(Path(k8s_cluster.kubeconfig).read_text())
    original = config["current-context"]
    user = next(c for c in config["contexts"] if c["name"] == original)["context"]["user"]
    config["clusters"].append({"name": "elsewhere", "cluster": {"server": elsewhere_api}})
    config["contexts"].append(
        {"name": "elsewhere", "context": {"cluster": "elsewhere", "user": user}}
    )
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))

    out = tmp_path / "rl-kept"
    done = rollout(
        "run",
        *real_node_flags(real_node),
        "--count",
        "2",
        "--output",
        str(out),
        "--keep",
        "--json",
        env=cli_env(kubeconfig, real_stack.redis_url),
        timeout=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    batch_id = report["batch_id"]
    assert report["successful_episodes"] == 2 and report["cleanup"] == "kept"
    receipt = read_receipt_file(out)
    assert receipt["context"] == original and receipt["run"]["context"] == original
    [namespace] = batch_namespaces(k8s_cluster, batch_id)  # kept: still there

    # Another context becomes current: a cluster where nothing exists.
    config["current-context"] = "elsewhere"
    kubeconfig.write_text(yaml.safe_dump(config))
    done = rollout("cleanup", "--output", str(out), env=cli_env(kubeconfig), timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"deleted run of batch {batch_id}" in done.stdout
    # Deleted in the cluster the run was created in, and nothing was asked of the current one.
    assert batch_namespaces(k8s_cluster, batch_id) == []
    with pytest.raises(ApiException) as gone:
        k8s_cluster.core.read_namespace(namespace["name"])
    assert gone.value.status == 404
    assert NotFoundApi.requests == []
    forget_batch(real_stack.redis_url, batch_id)


# -- 2. the receipt in --output names the run before the CLI dies ---------------------------
def test_cli_killed_after_the_namespace_exists_leaves_a_receipt_that_cleanup_uses(
    real_node, real_stack, k8s_cluster, tmp_path
):
    out = tmp_path / "rl-killed"
    env = cli_env(k8s_cluster.kubeconfig, real_stack.redis_url)
    with open(tmp_path / "cli.log", "wb") as log:
        proc = subprocess.Popen(
            [
                *CLI,
                "run",
                *real_node_flags(real_node),
                "--count",
                "2",
                "--action",
                "hang",
                "--deadline",
                "900",
                "--output",
                str(out),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    client = RolloutClient(real_stack.redis_url)
    batch_id = None
    try:
        batch_id = wait_for(
            "receipt.json with the batch id", lambda: read_receipt_file(out).get("batch_id"), 30
        )
        first = read_receipt_file(out)
        # Written before the batch is sent ("submitting"), then mirrored ("running").
        assert first["state"] in ("submitting", "running"), first
        if first["state"] == "submitting":
            assert first["redis_key"] == k.receipt_key(batch_id)
        [namespace] = wait_for(
            "the batch namespace", lambda: batch_namespaces(k8s_cluster, batch_id), 120
        )
        seen_at = time.monotonic()
        # The CLI mirrors the workers' receipt about once a second while it waits.
        mirrored = wait_for(
            "receipt.json naming the namespace UID",
            lambda: read_receipt_file(out).get("uid") and read_receipt_file(out),
            5,
            step=0.05,
        )
        lag = time.monotonic() - seen_at
        assert proc.poll() is None, (tmp_path / "cli.log").read_text()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

        receipt = read_receipt_file(out)
        assert receipt.get("uid") == namespace["uid"] == mirrored["uid"]
        assert receipt["namespace"] == namespace["name"] == f"rollout-{batch_id}"
        assert receipt["context"] == client.receipt(batch_id)["context"]
        assert receipt["state"] == "running"
        assert not (out / "results.json").exists()
        had_job_uid = "job_uid" in receipt

        # The workers still follow the batch, whose episodes hang: cancel it, so its report is
        # exactly "cancelled" (the run is kept: the CLI asked for it with --output), and then
        # delete the run with nothing but the receipt the killed CLI left.
        client.cancel(batch_id)
        report = client.wait(batch_id, 180)
        assert_cancelled(report, 2)
        assert report["cleanup"] == "kept", report["cleanup"]
        assert [ns["uid"] for ns in batch_namespaces(k8s_cluster, batch_id)] == [receipt["uid"]]

        done = rollout(
            "cleanup", "--output", str(out), env=cli_env(k8s_cluster.kubeconfig), timeout=200
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"deleted run of batch {batch_id}" in done.stdout
        assert batch_namespaces(k8s_cluster, batch_id) == []
        print(
            f"receipt.json named the namespace UID {lag:.2f}s after it was seen in the API "
            f"(the Job's UID {'too' if had_job_uid else 'not yet'})"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if batch_id and client.report(batch_id) is None:
            # The test stopped before its cancel: stop the batch so nothing of it outlives the
            # test (what the report says was asserted above, or the test failed before).
            client.cancel(batch_id)
            client.wait(batch_id, 180)
        if batch_id:
            forget_batch(real_stack.redis_url, batch_id)
        client.close()


def test_cleanup_of_a_receipt_cut_before_the_job_uid_deletes_the_run(
    real_node, real_stack, k8s_cluster, tmp_path
):
    """The CLI killed between the namespace's UID and the Job's reaching receipt.json (the Job
    exists): the namespace UID and the labels of the namespace and the Job prove the run."""
    client = RolloutClient(real_stack.redis_url)
    try:
        batch = client.submit(
            backend="kubernetes", count=1, keep_run=True, **real_node.batch_fields()
        )
        report = batch.wait(300)
        assert report["cleanup"] == "kept", report
        stored = client.receipt(batch.batch_id)
        [namespace] = batch_namespaces(k8s_cluster, batch.batch_id)
        assert k8s_cluster.batch.list_namespaced_job(namespace["name"]).items  # the Job exists
        early = tmp_path / "rl-cut"
        early.mkdir()
        cut = {"batch_id": batch.batch_id, "backend": "kubernetes", "state": "running"} | {
            key: stored[key] for key in ("context", "namespace", "run_id", "uid")
        }
        (early / "receipt.json").write_text(json.dumps(cut))
        done = rollout("cleanup", "--output", str(early), env=cli_env(k8s_cluster.kubeconfig))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"deleted run of batch {batch.batch_id}" in done.stdout
        assert batch_namespaces(k8s_cluster, batch.batch_id) == []
        forget_batch(real_stack.redis_url, batch.batch_id)
    finally:
        client.close()


# -- 3. cancel ------------------------------------------------------------------------------
def watch_cancel(
    cluster, namespace: str, started: float, timeout: float = 90
) -> tuple[float, float]:
    """Seconds after `started` until the Job is seen suspended, and until no Pod is left (the
    namespace itself still there and not being deleted)."""
    suspended_after = pods_gone_after = None
    while pods_gone_after is None:
        assert time.monotonic() - started < timeout, (
            f"Job suspended after {suspended_after}s, Pods not gone within {timeout:.0f}s"
        )
        job = cluster.batch.read_namespaced_job(JOB_NAME, namespace)
        if suspended_after is None and job.spec.suspend:
            suspended_after = time.monotonic() - started
        if suspended_after is not None and not cluster.core.list_namespaced_pod(namespace).items:
            pods_gone_after = time.monotonic() - started
        time.sleep(0.2)
    assert suspended_after is not None
    # The Job's controller removed the Pods, not a deletion of the run.
    assert cluster.core.read_namespace(namespace).metadata.deletion_timestamp is None
    return suspended_after, pods_gone_after


def assert_cancelled(report: dict[str, Any], count: int) -> None:
    assert report["status"] == "cancelled" and report["ok"] is False, report["status"]
    assert report["episodes"] == count and report["successful_episodes"] == 0
    rows = sorted(report["pods"], key=lambda row: row["index"])
    assert [row["index"] for row in rows] == list(range(count))
    for row in rows:
        assert row["reward"] in (0, 0.0), row
        assert any("cancelled" in error for error in row["errors"]), row


def test_rollout_cancel_suspends_the_job_its_pods_go_and_the_report_says_cancelled(
    real_node, real_stack, k8s_cluster, tmp_path
):
    out = tmp_path / "rl-cancelled"
    env = cli_env(k8s_cluster.kubeconfig, real_stack.redis_url)
    with open(tmp_path / "run.log", "wb") as log:
        run = subprocess.Popen(
            [
                *CLI,
                "run",
                *real_node_flags(real_node),
                "--count",
                "3",
                "--action",
                "hang",
                "--deadline",
                "600",
                "--output",
                str(out),
                "--keep",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    client = RolloutClient(real_stack.redis_url)
    batch_id = None
    try:
        batch_id = wait_for(
            "receipt.json with the batch id", lambda: read_receipt_file(out).get("batch_id"), 30
        )
        namespace = f"rollout-{batch_id}"
        wait_for("3 Pods running", lambda: len(running_pods(k8s_cluster, namespace)) == 3, 180)
        started = time.monotonic()
        cancel = subprocess.Popen(
            [*CLI, "cancel", batch_id, "--timeout", "180"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        suspended_after, pods_gone_after = watch_cancel(k8s_cluster, namespace, started)
        text, _ = cancel.communicate(timeout=240)
        assert cancel.returncode == 0, text
        assert f"batch {batch_id}: cancelled, 0 of 3" in text
        reported_after = time.monotonic() - started

        # The waiting `rollout run` gets the report too, and writes it.
        assert run.wait(120) == 1, (tmp_path / "run.log").read_text()
        results = json.loads((out / "results.json").read_text())
        assert results["batch_id"] == batch_id and results["cleanup"] == "kept"
        assert_cancelled(results, 3)
        assert_cancelled(client.report(batch_id) or {}, 3)

        done = rollout("cleanup", "--output", str(out), env=cli_env(k8s_cluster.kubeconfig))
        assert done.returncode == 0, done.stdout + done.stderr
        assert batch_namespaces(k8s_cluster, batch_id) == []
        print(
            f"rollout cancel: Job suspended {suspended_after:.1f}s, Pods gone "
            f"{pods_gone_after:.1f}s, report {reported_after:.1f}s after the cancel"
        )
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
        if batch_id and client.report(batch_id) is None:
            client.cancel(batch_id)
            client.wait(batch_id, 180)
        if batch_id:
            forget_batch(real_stack.redis_url, batch_id)
        client.close()


def test_client_cancel_reports_cancelled_and_the_run_is_then_deleted(
    real_node, real_stack, k8s_cluster
):
    client = RolloutClient(real_stack.redis_url)
    batch = client.submit(
        backend="kubernetes",
        count=3,
        action="hang",
        deadline_seconds=600,
        **real_node.batch_fields(),
    )
    namespace = f"rollout-{batch.batch_id}"
    try:
        wait_for("3 Pods running", lambda: len(running_pods(k8s_cluster, namespace)) == 3, 180)
        started = time.monotonic()
        batch.cancel()
        report = batch.wait(180)
        reported_after = time.monotonic() - started
        assert_cancelled(report, 3)
        assert report["cleanup"] == "scheduled"
        # Not kept: the workers delete the run after its report.
        gone_in = wait_gone(k8s_cluster, batch.batch_id)
        print(
            f"client cancel: report {reported_after:.1f}s after the cancel, namespace gone "
            f"{gone_in:.1f}s after the report"
        )
    finally:
        if client.report(batch.batch_id) is None:
            client.cancel(batch.batch_id)
            client.wait(batch.batch_id, 180)
        client.close()


# -- 4. the sweeper -------------------------------------------------------------------------
def sweep_lines(text: str) -> dict[str, str]:
    """`rollout sweep` output: {batch id: action}."""
    actions = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            actions[parts[1]] = parts[0]
    return actions


def test_sweep_deletes_a_kept_run_whose_receipt_expired_and_leaves_strangers(
    real_node, real_stack, k8s_cluster
):
    client = RolloutClient(real_stack.redis_url)
    stranger = f"stranger-{uuid.uuid4().hex[:8]}"
    stranger_ns = f"rollout-test-{stranger}"
    k8s_cluster.core.create_namespace(
        {
            "metadata": {
                "name": stranger_ns,
                "labels": {k.LABEL_OWNER: k.LABEL_OWNER_VALUE, k.LABEL_BATCH: stranger},
            }
        }
    )
    env = cli_env(k8s_cluster.kubeconfig, real_stack.redis_url)
    try:
        batch = client.submit(
            backend="kubernetes", count=1, keep_run=True, **real_node.batch_fields()
        )
        report = batch.wait(300)
        assert report["successful_episodes"] == 1 and report["cleanup"] == "kept"
        [kept] = batch_namespaces(k8s_cluster, batch.batch_id)
        assert not kept["deleting"]

        # A kept run, not past its TTL, with its receipt: the sweeper leaves it alone.
        done = rollout("sweep", "--dry-run", env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert batch.batch_id not in sweep_lines(done.stdout), done.stdout

        # Its receipt expires (simulated): nothing but the sweeper would ever delete it.
        r = redis.Redis.from_url(real_stack.redis_url)
        try:
            assert r.delete(k.receipt_key(batch.batch_id)) == 1
        finally:
            r.close()

        done = rollout("sweep", "--dry-run", env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        actions = sweep_lines(done.stdout)
        assert actions.get(batch.batch_id) == "would-delete", done.stdout
        assert actions.get(stranger) == "left", done.stdout
        assert batch_namespaces(k8s_cluster, batch.batch_id) == [kept]  # a dry run deletes nothing

        # The sweep asks Kubernetes to delete the namespace and does not wait: "deleting".
        done = rollout("sweep", env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        actions = sweep_lines(done.stdout)
        assert actions.get(batch.batch_id) == "deleting", done.stdout
        assert actions.get(stranger) == "left", done.stdout
        assert registered(real_stack.redis_url, batch.batch_id)  # not gone yet: remembered
        gone_in = wait_gone(k8s_cluster, batch.batch_id)

        # Once gone, the next sweep finds it gone ("deleted") and forgets it; the stranger is
        # still only listed.
        done = rollout("sweep", env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        actions = sweep_lines(done.stdout)
        assert actions.get(batch.batch_id) == "deleted", done.stdout
        assert actions.get(stranger) == "left", done.stdout
        assert not registered(real_stack.redis_url, batch.batch_id)
        stranger_now = k8s_cluster.core.read_namespace(stranger_ns)
        assert stranger_now.metadata.deletion_timestamp is None
        print(f"sweep: kept run gone {gone_in:.1f}s after `rollout sweep`")
    finally:
        kc.delete_namespace(k8s_cluster, stranger_ns)
        client.close()

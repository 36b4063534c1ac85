"""The command lines as users run them (real processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rollout_worker.cli.stack import free_port

pytestmark = [pytest.mark.redis, pytest.mark.workers]


def rollout(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "rollout_worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_all_in_one_run_prints_the_report_writes_records_and_leaves_nothing_running(tmp_path):
    out = tmp_path / "rl-parallel-10"
    done = rollout("run", "--count", "10", "--all-in-one", "--output", str(out), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["episodes"], report["successful_episodes"], report["reward_sum"]) == (10, 10, 10)
    assert report["client_submit_to_report_seconds"] > 0
    # --all-in-one stops its workers only after they deleted the run (not kept: no k8s).
    assert report["cleanup"] == "scheduled" and not os.path.exists(report["run"]["run_dir"])
    results = json.loads((out / "results.json").read_text())
    assert results["ok"] is True and len(results["pods"]) == 10
    # The guide's client_job_complete_seconds: this client's submit -> it saw the run complete
    # (the receipt's completed_at, which follows the report), next to the existing timings.
    assert results["client_job_complete_seconds"] > 0
    assert results["client_job_complete_seconds"] >= results["client_submit_to_report_seconds"]
    assert results["job_complete_seconds"] > 0
    assert report["client_job_complete_seconds"] == pytest.approx(
        results["client_job_complete_seconds"]
    )
    for row in results["pods"]:
        log = (out / f"{row['pod']}.log").read_text()
        assert '"event": "ready"' in log and '"event": "reward"' in log
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["batch_id"] == report["batch_id"] and receipt["run"]["run_uid"]
    # The client's own fields survive the mirroring of the workers' receipt.
    assert report["batch_id"] in receipt["redis_key"] and receipt["state"] == "reported"
    stack_dir = re.search(r"logs in (\S+)\)", done.stderr).group(1)
    assert not os.path.exists(stack_dir)
    leftovers = subprocess.run(["pgrep", "-f", stack_dir], capture_output=True, text=True)
    assert leftovers.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--count", "0"], "count must be at least 1"),
        (["--count", "5", "--parallelism", "6"], "parallelism"),
        (["--count", "5", "--image", "NOT VALID"], "image"),
        (["--count", "5", "--memory-limit", "lots"], "memory_limit 'lots' is not a quantity"),
        (["--count", "5", "--memory-limit", "16Mi"], "below 32Mi"),
        (["--count", "5", "--storage-limit", "lots"], "storage_limit 'lots' is not a quantity"),
        (["--count", "5", "--storage-limit", "100Ki"], "storage_limit 100Ki is below 1Mi"),
        (["--count", "6000"], "configured maximum"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(tmp_path, args, message):
    out = tmp_path / "out"
    done = rollout("run", *args, "--all-in-one", "--output", str(out), timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert "all-in-one" not in done.stderr  # no stack was started
    assert not out.exists()


def test_existing_output_directory_is_never_overwritten(tmp_path):
    done = rollout("run", "--count", "1", "--all-in-one", "--output", str(tmp_path), timeout=60)
    assert done.returncode == 2 and "already exists" in done.stderr


def test_trainer_stub_runs_rounds_concurrently(stack):
    done = subprocess.run(
        [sys.executable, "-m", "trainer_stub.cli", "--rounds", "3", "--count", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ROLLOUT_REDIS_URL": stack.redis_url},
    )
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(reports) == 3 and len({r["batch_id"] for r in reports}) == 3
    assert all(r["reward_sum"] == 5 and r["ok"] for r in reports)
    assert sorted(r["labels"]["round"] for r in reports) == ["0", "1", "2"]


def test_trainer_stub_samples_continuously_and_shows_each_group(stack):
    from rollout_worker.cli.policy_server import running

    with running() as server:
        done = subprocess.run(
            [
                *(sys.executable, "-m", "trainer_stub.cli", "--continuous", "--rounds", "2"),
                *("--tasks", "bundled", "--task", "shipping-boundary", "--task", "leap-year"),
                *("--samples", "2", "--policy-url", server.url, "--groups-in-flight", "2"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "ROLLOUT_REDIS_URL": stack.redis_url, "COLUMNS": "120"},
        )
    assert done.returncode == 0, done.stderr
    shown = [line for line in done.stderr.splitlines() if line.startswith("group ")]
    assert len(shown) == 4 and all("complete" in line for line in shown), done.stderr
    assert "continuous sampling: 4 groups" in done.stdout and "groups/s" in done.stdout


def test_check_reports_workers_per_queue(stack):
    done = rollout(
        "check", "--no-kubernetes", env={"ROLLOUT_REDIS_URL": stack.redis_url}, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "queue control: 1 worker" in done.stdout
    assert "queue collect: 2 worker" in done.stdout


def test_check_fails_clearly_without_redis():
    done = rollout("check", "--redis-url", "redis://127.0.0.1:1/0", timeout=60)
    assert done.returncode != 0 and "not reachable" in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["rollout", "run", "--count", "1", "--output", "{out}"],
        ["trainer-stub", "--rounds", "1", "--count", "1"],
        ["rollout", "cancel", "0123456789abcdef"],
    ],
    ids=["run", "trainer-stub", "cancel"],
)
def test_redis_unreachable_is_one_line_naming_the_url_and_leaves_no_directory(tmp_path, command):
    url = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    out = tmp_path / "out"
    module = "trainer_stub.cli" if command[0] == "trainer-stub" else "rollout_worker.cli"
    args = [arg.format(out=out) for arg in command[1:]]
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        # A short outage limit: every client call waits this long, then says so.
        env={**os.environ, "ROLLOUT_REDIS_OUTAGE_SECONDS": "1"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    masked = url.replace("s3cret-pw", "***")
    assert f"Redis at {masked} unreachable for 1s" in lines[0]
    assert "s3cret-pw" not in done.stdout + done.stderr
    assert not out.exists()  # the same command can run again once Redis is back

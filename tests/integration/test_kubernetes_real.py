"""The guide's run on the local cluster's real node: Pods really run the episode program in
containers; the pipeline reads their real logs and termination messages."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from tests.integration.guide import GUIDE_FIELDS, GUIDE_ROW_FIELDS

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]


@pytest.mark.parametrize("parallelism", [10, 1])
def test_guide_run_on_the_real_node(real_node, real_stack, k8s_cluster, tmp_path, parallelism):
    out = tmp_path / f"rl-{parallelism}-10"
    args = [
        "run",
        "--count",
        "10",
        "--parallelism",
        str(parallelism),
        *real_node.run_flags(),
        "--output",
        str(out),
        "--no-keep",
        "--json",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rollout_worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={
            **os.environ,
            "ROLLOUT_REDIS_URL": real_stack.redis_url,
            "KUBECONFIG": str(k8s_cluster.kubeconfig),
        },
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(GUIDE_FIELDS) <= set(results), set(GUIDE_FIELDS) - set(results)
    assert (results["episodes"], results["successful_episodes"], results["reward_sum"]) == (
        10,
        10,
        10,
    )
    assert results["parallelism"] == parallelism
    assert results["nodes"] == {real_node.name: 10}
    for row in results["pods"]:
        assert set(GUIDE_ROW_FIELDS) <= set(row)
        assert row["image_id"] and not row["image_id"].startswith("kwok://")
        assert row["restart_count"] == 0 and row["exit_code"] == 0
        log = (out / f"{row['pod']}.log").read_text()
        events = [json.loads(line) for line in log.splitlines() if line.strip()]
        assert [e["event"] for e in events] == ["ready", "reward"]
        assert all(e["episode_id"] == row["pod"] for e in events)
    assert {"scheduling", "container_start", "runtime_init"} <= set(results["phases"])
    if parallelism == 1:
        # Sequential: each episode's Pod is created only after the previous one finished
        # (Kubernetes timestamps have 1 s resolution).
        rows = sorted(results["pods"], key=lambda r: r["created_at"])
        for before, after in itertools.pairwise(rows):
            assert after["created_at"] >= before["finished_at"] - 1.0
    for name in ("job.json", "pods.json", "events.txt", "receipt.json", "job-submitted.json"):
        assert (out / name).exists()

"""The guide's run on the local cluster's real node: Pods really run the episode program in
containers; the pipeline reads their real logs and termination messages."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_wire import constants as k
from rollout_wire.codec import decode_entry
from tests.integration.guide import GUIDE_FIELDS, GUIDE_ROW_FIELDS
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]


@pytest.mark.parametrize("parallelism", [10, 1])
def test_guide_run_on_the_real_node(real_node, real_stack, k8s_cluster, tmp_path, parallelism):
    out = tmp_path / f"rl-{parallelism}-10"
    bridge = node_bridge() if k8s_cluster.local else None
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
    if bridge is not None:
        # The local node's bridge keeps a MAC of its own (addr_assign_type 3: set), not its
        # lowest port's, which changes as Pods come and go under the Pods' ARP caches.
        assert node_bridge() == bridge and bridge[1] == "3", bridge


def node_bridge() -> tuple[str, str]:
    """(MAC, addr_assign_type) of the local real node's bridge (hack/localkube/node.sh)."""
    path = Path("/sys/class/net") / f"rollout{os.environ.get('ROLLOUT_LOCALKUBE_NODE_ID', '0')}"
    return (path / "address").read_text().strip(), (path / "addr_assign_type").read_text().strip()


def _states_by_time(client, batch_id: str) -> dict[tuple[int, str], float]:
    """When (the stream entry's own time, in seconds) each episode's progress state and row
    were published: the workers wrote these, the test only reads them."""
    seen: dict[tuple[int, str], float] = {}
    for entry_id, data in client.redis.xrange(k.stream_key(batch_id)):
        entry = decode_entry(data)
        if entry.index is None:
            continue
        what = entry.status if entry.type == k.ENTRY_STATE else entry.type
        seen[(entry.index, str(what))] = int(entry_id.split(b"-")[0]) / 1000
    return seen


def test_progress_on_the_real_node_shows_ready_from_the_runner_and_rewarded_before_the_row(
    real_node, real_stack
):
    client = RolloutClient(real_stack.redis_url)
    fields = real_node.batch_fields() | {"backend": "kubernetes", "parallelism": 2}
    # Episodes that say ready and then hang until their own deadline: "ready" can only come
    # from the runner's event (there is no row, no reward and no end to learn it from).
    hung = client.submit(**fields, count=2, action="hang", episode_timeout_seconds=20)
    fixed = client.submit(**fields, count=2, action="fix")
    hung_report = client.wait(hung.batch_id, timeout=300)
    fixed_report = client.wait(fixed.batch_id, timeout=300)
    assert hung_report["successful_episodes"] == 0 and fixed_report["successful_episodes"] == 2
    hung_states = _states_by_time(client, hung.batch_id)
    for row in hung_report["pods"]:
        index = row["index"]
        assert row["ready_at"] is not None, row  # the runner did say ready (from its log)
        ready = hung_states.get((index, "ready"))
        assert ready is not None, hung_states
        # Published after the runner's event (same clock: the node is this machine), and
        # long before the episode ended at its deadline.
        assert row["ready_at"] - 0.01 <= ready < row["finished_at"] - 5, (row, ready)
        assert (index, "rewarded") not in hung_states
    fixed_states = _states_by_time(client, fixed.batch_id)
    for row in fixed_report["pods"]:
        index = row["index"]
        assert fixed_states[(index, "rewarded")] <= fixed_states[(index, "episode")]
    # Leave nothing behind on the shared cluster: the workers' cleanup of both runs ends
    # before this stack stops.
    deadline = time.monotonic() + 180
    for batch_id in (hung.batch_id, fixed.batch_id):
        while client.receipt(batch_id).get("cleanup") != "deleted":
            assert time.monotonic() < deadline, client.receipt(batch_id)
            time.sleep(0.5)
    client.close()

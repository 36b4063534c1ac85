"""Tasks that need different images run as one Job per image inside one batch: one chord, one
report, each episode in its own task's image (on the local cluster's real node)."""

from __future__ import annotations

import pytest

from rollout_wire.tasksets import load_task_set
from rollout_worker.cli.policy_server import running
from tests.helm.test_chart_install import kube_images
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]


def test_tasks_needing_two_images_run_as_two_jobs_of_one_batch(real_node, real_stack, k8s_cluster):
    # A second image with Python on the node: the workers' own image (built and imported).
    second = kube_images()["ROLLOUT_KUBE_IMAGE"]
    node = k8s_cluster.core.read_node(real_node.name)
    host = next(a.address for a in node.status.addresses if a.type == "InternalIP")
    shipping, fizzbuzz = load_task_set("bundled", only=["shipping-boundary", "fizzbuzz-order"])
    tasks = [dict(fizzbuzz, image=second), shipping]
    client = RolloutClient(real_stack.redis_url)
    with running(host="0.0.0.0") as server:
        submission = client.submit(
            **real_node.batch_fields()
            | {
                "backend": "kubernetes",
                "tasks": tasks,
                "samples_per_task": 2,
                "parallelism": 3,
                "policy": {"url": f"http://{host}:{server.port}", "request_timeout_seconds": 10},
                "capacity_check": "warn",
            }
        )
        report = client.wait(submission.batch_id, timeout=600)
    assert report["ok"], report["errors"]
    # Grouped by image, in the order the images first appear: one Job each.
    assert [t["id"] for t in submission.spec.tasks] == ["fizzbuzz-order", "shipping-boundary"]
    assert sorted(report["run"]["jobs"]) == ["rollout", "rollout-1"]
    rows = {row["index"]: row for row in report["pods"]}
    assert [rows[i]["task_id"] for i in range(4)] == ["fizzbuzz-order"] * 2 + [
        "shipping-boundary"
    ] * 2
    assert [rows[i]["reward"] for i in range(4)] == [1, 0, 1, 1]  # fizzbuzz sample 1: wrong fix
    images = {row["task_id"]: set() for row in rows.values()}
    for row in rows.values():
        images[row["task_id"]].add(row["image_id"])
    assert len(images["fizzbuzz-order"]) == 1 and len(images["shipping-boundary"]) == 1
    assert images["fizzbuzz-order"] != images["shipping-boundary"]
    groups = {g["task_id"]: g for g in report["groups"]}
    assert groups["fizzbuzz-order"]["rewards"] == [1, 0]
    assert groups["shipping-boundary"]["status"] == "complete"

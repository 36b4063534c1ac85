"""The episode's disk limit on the local cluster's real node, the Kubernetes twin of
test_disk_limit.py: a Harbor task stating `storage_mb = 64` (the batch's storage_limit) whose
agent writes 80 MiB and waits. The kubelet evicts its Pod for its own limit (a container's,
the Pod's or an emptyDir's), and the row is the agent's failure: `episode` kind
(StorageLimitExceeded and the kubelet's message), reward 0, never retried (--infra-retries 1)."""

from __future__ import annotations

import time

import pytest

from rollout_wire.harbor import scan
from tests.integration.test_red_team import NEVER_ASKED
from tests.unit.test_harbor import make_task
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.k8s, pytest.mark.k8s_real, pytest.mark.redis, pytest.mark.workers]

# 80 MiB on the container's writable root when the image lets uid 1000 write /var/tmp (the
# kubelet sees a container's layer within its 10 s check), else in the workspace (an emptyDir:
# seen when the kubelet next measures its volumes); then it waits to be evicted.
FILL = "head -c 83886080 /dev/zero > /var/tmp/fill || head -c 83886080 /dev/zero > fill; sleep 170"


def test_an_agent_that_fills_its_disk_is_evicted_as_its_own_failure(
    real_node, real_stack, open_tmp_path
):
    make_task(
        open_tmp_path,
        "fill-disk",
        toml="[agent]\ntimeout_sec = 180\n[environment]\nstorage_mb = 64\n",
        tests={
            "test.sh": "#!/bin/bash\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n"
        },
    )
    (mapped,) = scan(open_tmp_path)
    task = mapped.task | {"agent": {"command": ["sh", "-c", FILL]}}
    client = RolloutClient(real_stack.redis_url)
    began = time.monotonic()
    try:
        batch = client.submit(
            **real_node.batch_fields(),
            backend="kubernetes",
            tasks=[task],
            samples_per_task=1,
            policy=NEVER_ASKED,
            infra_retries=1,
            resources={"storage_limit": "64Mi"},
            episode_timeout_seconds=240,
            deadline_seconds=300,
            capacity_check="warn",
        )
        report = client.wait(batch.batch_id, timeout=400)
    finally:
        client.close()
    seconds = time.monotonic() - began
    (row,) = report["pods"]
    assert row["status"] == "failed" and row["reward"] == 0, row
    assert row["failure_kind"] == "episode", row
    assert "StorageLimitExceeded: " in row["failure_cause"], row
    assert row["retried"] == [], row
    (group,) = report["groups"]
    assert group["status"] == "incomplete" and group["failed"][0]["failure_kind"] == "episode"
    print(f"an episode evicted for its disk on the real node: {seconds:.1f} s")
    print(f"  its cause: {row['failure_cause']}")

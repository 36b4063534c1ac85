"""Warm pools, pure parts: which batches share a pool, a pool Pod's spec, the claim patch, the
hand-over line and what the runner makes of it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from rollout_wire import constants as k
from rollout_wire.errors import InvalidSpec
from rollout_wire.request import parse_spec
from rollout_worker.backends import warm
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube import objects, read
from rollout_worker.backends.kube.objects import job_manifest, job_parts
from rollout_worker.backends.kube.read import completion_index, observe_pods
from rollout_worker.sandbox import episode_program_text as program
from tests.runner_program import episode

POLICY = {"url": "http://10.0.0.7:8000", "model": "m"}
TASKS = [
    {"id": f"t{n}", "statement": "fix it", "files": {"a.py": "x = 1\n"}, "test_command": ["false"]}
    for n in (1, 2)
]


def spec(**changes):
    counted = {} if "tasks" in changes else {"count": 4}
    return parse_spec({**counted, "backend": "kubernetes", **changes}, max_episodes=100)


def test_batches_of_one_shape_share_a_pool_and_any_difference_in_shape_splits_it():
    base = warm.pool_key(spec(), program())
    assert base is not None and base == warm.pool_key(spec(count=9, action="none"), program())
    for other in (
        spec(image="python:3.13-slim"),
        spec(runtime="gvisor"),
        spec(resources={"cpu_limit": "1"}),
        spec(node_selector={"zone": "a"}),
        spec(policy=POLICY, tasks=TASKS),
    ):
        assert warm.pool_key(other, program()) not in (None, base)
    assert warm.pool_key(spec(), program() + "#") != base  # a new runner: a new pool
    # Another policy endpoint: another pool (egress is fixed when a Pod starts).
    moved = spec(policy=POLICY | {"url": "http://10.0.0.8:8000"}, tasks=TASKS)
    assert warm.pool_key(moved, program()) != warm.pool_key(
        spec(policy=POLICY, tasks=TASKS), program()
    )
    assert warm.pool_key(spec(infra_retries=1), program()) is None


def test_warm_pool_requests_are_refused_when_no_pool_can_serve_them():
    for bad, word in (
        ({"warm_pool": -1}, "warm_pool must be within"),
        ({"warm_pool": 2, "infra_retries": 1}, "infra_retries"),
    ):
        with pytest.raises(InvalidSpec, match=word):
            spec(**bad)


def test_a_pool_pod_is_isolated_like_a_cold_one_and_waits_on_stdin():
    s = spec()
    key = warm.pool_key(s, program())
    pod = objects.pool_pod_manifest(s, key, idle_seconds=600)
    cold = job_manifest(s, ttl_seconds_after_finished=60)["spec"]["template"]["spec"]
    for field in ("securityContext", "automountServiceAccountToken", "enableServiceLinks"):
        assert pod["spec"][field] == cold[field]
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"] == cold["containers"][0]["securityContext"]
    assert container["stdin"] and container["stdinOnce"]
    assert "startupProbe" not in container  # no exec into every waiting Pod each second
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ROLLOUT_HANDOVER"] == "stdin" and "ROLLOUT_ACTION" not in env
    assert pod["metadata"]["labels"] == {
        k.LABEL_OWNER: k.LABEL_OWNER_VALUE,
        k.LABEL_POOL: key,
        k.LABEL_POOL_STATE: objects.POOL_STATE_IDLE,
    }
    assert pod["spec"]["activeDeadlineSeconds"] == 600 + objects.LIFETIME_EXTRA_SECONDS + 120


def _running(started: str = "2026-12-01T10:00:00Z", lifetime: int = 4000) -> dict:
    return {
        "metadata": {"name": "warm-a", "uid": "u1", "resourceVersion": "77", "labels": {}},
        "spec": {"activeDeadlineSeconds": lifetime},
        "status": {"phase": "Running", "startTime": started},
    }


def test_a_claim_is_guarded_by_the_version_read_and_gives_the_episode_its_own_timeout():
    start = 1_796_119_200.0  # 2026-12-01T10:00:00Z
    pod = _running()
    started = read.pool_pod_started_at(pod)
    assert started == start
    patch = objects.claim_patch(pod, started, "b1", 3, episode_timeout=120, now=start + 50.2)
    assert patch is not None
    assert patch["metadata"]["resourceVersion"] == "77"
    assert patch["metadata"]["labels"] == {
        k.LABEL_BATCH: "b1",
        k.LABEL_POOL_STATE: objects.POOL_STATE_CLAIMED,
        k.LABEL_EPISODE_INDEX: "3",
    }
    assert patch["spec"]["activeDeadlineSeconds"] == 51 + 120  # from the Pod's start
    # Too little lifetime left for the episode's timeout: not claimed (it runs cold).
    assert objects.claim_patch(_running(lifetime=170), start, "b1", 3, 120, start + 50.2) is None


def test_a_claimed_pod_is_its_episode_from_the_claim_on():
    pod = _running()
    pod["metadata"] |= {
        "creationTimestamp": "2026-12-01T09:59:59Z",
        "labels": {k.LABEL_BATCH: "b1", k.LABEL_EPISODE_INDEX: "2"},
        "annotations": {k.ANNOTATION_CLAIMED_AT: "1796119250.5"},
    }
    assert completion_index(pod) == 2
    handle = KubeRunHandle("kubernetes", "b1", 1796119250.0, "rollout", "ctx")
    obs = observe_pods(handle, 2, {"u1": pod}, final=True)
    assert obs.created_at == 1796119250.5
    assert obs.timing["pool_created_at"] == 1796119199.0
    # Running and started (no probe) says nothing about its episode being ready.
    pod["status"]["containerStatuses"] = [
        {"name": "episode", "started": True, "state": {"running": {}}}
    ]
    assert observe_pods(handle, 2, {"u1": pod}, final=True).ready is False


def test_job_parts_leave_out_the_warm_episodes():
    parts = job_parts(spec(count=6, parallelism=6), warm={0, 1, 4})
    assert [(p.name, p.first, p.count) for p in parts] == [("rollout", 2, 2), ("rollout-1", 5, 1)]
    assert sum(p.parallelism for p in parts) <= 6
    assert job_parts(spec(count=2), warm={0, 1}) == []


def test_the_handover_line_carries_what_a_cold_pod_gets_from_its_spec(tmp_path, monkeypatch):
    s = spec(samples_per_task=2, policy=POLICY, tasks=TASKS)
    line = json.loads(warm.handover_line(s, 3))
    assert line["tasks"] == [s.tasks[1]]  # episode 3 = task t2, sample 1
    env = line["env"]
    assert (env["ROLLOUT_TASK_ID"], env["ROLLOUT_SAMPLE"], env["ROLLOUT_GROUP_ID"]) == (
        "t2",
        "1",
        f"{s.batch_id}:t2",
    )
    assert env["ROLLOUT_POLICY_URL"] == POLICY["url"]
    assert json.loads(env["ROLLOUT_POLICY"]) == s.policy.runner_config()
    assert "url" not in s.policy.runner_config()
    # The runner applies it: the same identity a cold Pod works out from its index.
    tasks_file = tmp_path / "tasks.json"
    env["ROLLOUT_TASKS_FILE"] = str(tasks_file)
    monkeypatch.setattr(os, "environ", {})
    assert episode.take_handover(io.StringIO(json.dumps(line) + "\n"))
    identity = episode.episode_identity()
    assert identity == {"task_id": "t2", "sample": 1, "group_id": f"{s.batch_id}:t2", "attempt": 0}
    assert episode.load_task(identity)["id"] == "t2"
    assert not episode.take_handover(io.StringIO(""))  # stdin closed: no episode


def test_a_waiting_runner_runs_the_demo_it_is_handed(tmp_path):
    line = warm.handover_line(spec(action="fix"), 0)
    runner = tmp_path / "program" / "episode.py"  # a file, as backends run it (too long for -c)
    runner.parent.mkdir()
    runner.write_text(program())
    (tmp_path / "ws").mkdir()
    done = subprocess.run(
        [sys.executable, "-B", str(runner)],
        input=line.decode(),
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": os.environ["PATH"],
            "EPISODE_ID": "warm-x",
            "ROLLOUT_HANDOVER": "stdin",
            "ROLLOUT_WORKSPACE": str(tmp_path / "ws"),
        },
    )
    events = [json.loads(x) for x in done.stdout.splitlines()]
    assert [e["event"] for e in events] == ["ready", "reward"], done.stderr
    assert events[1]["reward"] == 1 and done.returncode == 0

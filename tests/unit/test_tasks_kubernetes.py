"""Real rollouts on Kubernetes, the pure parts: tasks in the batch's ConfigMap, the runner's
environment, egress only to the policy endpoint; and the runner reading its task the way an
Indexed Job's Pod does (JOB_COMPLETION_INDEX), against the scripted policy over TCP."""

import json
import os
import subprocess
import sys

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import parse_spec
from rollout_wire.tasksets import load_task_set
from rollout_worker.backends.kube import objects
from rollout_worker.cli.policy_server import running
from rollout_worker.sandbox import episode_program_text

POLICY = {"url": "http://10.1.2.3:8000", "model": "m", "request_timeout_seconds": 5}


def spec(**changes):
    request = {
        "backend": "kubernetes",
        "tasks": load_task_set("bundled", only=["leap-year", "stack-pop"]),
        "samples_per_task": 3,
        "policy": POLICY,
    }
    return parse_spec(request | changes, max_episodes=100)


def test_tasks_ride_in_the_configmap_and_the_runner_gets_its_environment():
    s = spec()
    cm = objects.configmap_manifest(s, episode_program_text())
    assert [t["id"] for t in json.loads(cm["data"]["tasks.json"])] == ["leap-year", "stack-pop"]
    job = objects.job_manifest(s, ttl_seconds_after_finished=60)
    env = {
        e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["ROLLOUT_POLICY_URL"] == "http://10.1.2.3:8000"
    assert env["ROLLOUT_TASKS_FILE"] == "/demo/tasks.json"
    assert env["ROLLOUT_SAMPLES_PER_TASK"] == "3" and env["ROLLOUT_BATCH_ID"] == s.batch_id
    assert json.loads(env["ROLLOUT_POLICY"])["model"] == "m"
    # The demo (no policy) is unchanged: no tasks file, no runner environment.
    demo = parse_spec({"count": 3, "backend": "kubernetes"}, max_episodes=10)
    assert set(objects.configmap_manifest(demo, "x")["data"]) == {"episode.py"}
    assert "ROLLOUT_POLICY" not in str(objects.job_manifest(demo, ttl_seconds_after_finished=1))


def test_the_network_policy_allows_egress_to_the_policy_endpoint_only():
    policy = objects.network_policy_manifest(spec())["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in policy
    assert policy["egress"] == [
        {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"protocol": "TCP", "port": 8000}]}
    ]
    demo = parse_spec({"count": 3, "backend": "kubernetes"}, max_episodes=10)
    assert "egress" not in objects.network_policy_manifest(demo)["spec"]  # deny all


def test_kubernetes_refuses_a_policy_by_name():
    with pytest.raises(InvalidSpec) as info:
        spec(
            policy=POLICY | {"url": "http://policy.example:8000"},
            tasks=[dict(load_task_set("bundled")[0], image="python:3.11-alpine")],
        )
    assert [p for p in info.value.problems if "must be an IP address on kubernetes" in p]


def test_the_configmap_is_refused_above_the_api_servers_limit():
    s = spec()
    with pytest.raises(ValueError, match="split the task set"):
        objects.configmap_manifest(s, "#" * objects.CONFIGMAP_MAX_BYTES)


def test_the_runner_finds_its_task_from_the_completion_index_and_calls_the_policy_url(tmp_path):
    s = spec(policy=POLICY | {"url": "http://127.0.0.1:1"})
    program = tmp_path / "episode.py"
    program.write_text(episode_program_text())
    (tmp_path / "tasks.json").write_text(objects.tasks_text(s) or "")
    with running() as server:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        env = {
            "PATH": os.environ["PATH"],
            "EPISODE_ID": "rollout-b-4-abcde",
            "ROLLOUT_WORKSPACE": str(workspace),
            "JOB_COMPLETION_INDEX": "4",  # task 1 (stack-pop), sample 1
            "ROLLOUT_TASKS_FILE": str(tmp_path / "tasks.json"),
            "ROLLOUT_SAMPLES_PER_TASK": "3",
            "ROLLOUT_BATCH_ID": s.batch_id,
            "ROLLOUT_POLICY": json.dumps({"model": "m", "request_timeout_seconds": 5}),
            "ROLLOUT_POLICY_URL": server.url,
        }
        done = subprocess.run(
            [sys.executable, "-B", str(program)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        calls = server.calls()
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert events[0]["task_id"] == "stack-pop" and events[0]["sample"] == 1
    assert events[0]["policy_base_url"] == f"{server.url}/rollout/rollout-b-4-abcde/v1"
    assert events[-1]["event"] == "reward" and events[-1]["reward"] == 1
    assert {c["group_id"] for c in calls} == {f"{s.batch_id}:stack-pop"}
    assert {c["path"] for c in calls} == {"/rollout/rollout-b-4-abcde/v1/chat/completions"}

"""Tasks with steps on Kubernetes (kube/pod_steps.py): the Pod runs each step's agent and each
step's tests in containers of their own, in order, over one workspace. What each container
mounts is what keeps a step's tests from every agent and a later step's statement from an
earlier agent; the real node runs it in tests/integration/test_harbor_steps_k8s.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from rollout_wire.harbor import scan
from rollout_wire.request import parse_spec
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube.objects import configmap_manifest, job_manifest
from rollout_worker.backends.kube.read import observe_pods
from tests.unit.test_manifests import pod

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "harbor" / "multi-step" / "two-steps"
HIDDEN = {  # a task without steps, with hidden tests, in the same batch
    "id": "plain",
    "statement": "Fix it.",
    "files": {},
    "tests": {"test.sh": "echo the plain task's hidden check\n"},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
    "baseline": False,
}


def enc(text: str) -> str:
    """`text` as it appears inside a JSON document."""
    return orjson.dumps(text).decode()[1:-1]


def steps_task() -> dict[str, Any]:
    (mapped,) = scan(FIXTURE)
    return mapped.task


def batch(tasks: list[dict[str, Any]], agent: Any = "oracle") -> Any:
    request: dict[str, Any] = {"backend": "kubernetes", "tasks": tasks, "agent": agent}
    if agent != "oracle":
        request["policy"] = {"url": "http://10.0.0.5:8000"}
    return parse_spec(request | {"infra_retries": 1}, max_episodes=100)


def pod_spec_of(spec: Any) -> dict[str, Any]:
    return job_manifest(spec, ttl_seconds_after_finished=60)["spec"]["template"]["spec"]


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container["env"]}


def keys_of(pod_spec: dict[str, Any], volume: str) -> set[str]:
    found = next(v for v in pod_spec["volumes"] if v["name"] == volume)
    return {item["key"] for item in found["configMap"]["items"]}


def test_each_step_runs_an_agent_then_a_grader_the_last_being_the_pods_container():
    spec = batch([steps_task()])
    pod_spec = pod_spec_of(spec)
    names = [c["name"] for c in pod_spec["initContainers"]]
    assert names == ["agent", "grade-1", "agent-2"]
    (main,) = pod_spec["containers"]
    assert main["name"] == "episode" and "startupProbe" in main
    steps = {c["name"]: env(c)["ROLLOUT_STEP"] for c in [*pod_spec["initContainers"], main]}
    assert steps == {"agent": "1", "grade-1": "1", "agent-2": "2", "episode": "2"}
    assert env(main)["ROLLOUT_STEP_LAST"] == "1" and env(main)["ROLLOUT_PHASE"] == "grade"
    assert all("ROLLOUT_STEP_LAST" not in env(c) for c in pod_spec["initContainers"])
    assert env(pod_spec["initContainers"][1])["ROLLOUT_PHASE"] == "grade"
    # Every runner container's exit code counts under the retry budget's rules.
    rules = job_manifest(spec, ttl_seconds_after_finished=60)["spec"]["podFailurePolicy"]
    named = {r["onExitCodes"]["containerName"] for r in rules["rules"] if "onExitCodes" in r}
    assert named == {"agent", "grade-1", "agent-2", "episode"}
    # All share the workspace, /tmp, /logs and /solution, as one sandbox across its steps.
    for container in [*pod_spec["initContainers"], main]:
        shared = {p: m["name"] for p, m in mounts(container).items()}
        assert shared["/workspace"] == "workspace" and shared["/tmp"] == "tmp"
        assert shared["/logs"] == "agent-logs" and shared["/solution"] == "agent-solution"


def test_no_agent_container_mounts_a_steps_tests_or_a_later_steps_statement():
    spec = batch([steps_task(), HIDDEN], agent={"command": ["python", "-c", "pass"]})
    pod_spec = pod_spec_of(spec)
    data = configmap_manifest(spec, "program")["data"]
    first, second = steps_task()["steps"]
    agents = [c for c in pod_spec["initContainers"] if c["name"].startswith("agent")]
    assert [a["name"] for a in agents] == ["agent", "agent-2"]
    for number, agent in enumerate(agents, 1):
        seen = mounts(agent)
        # The tasks without tests or steps' text, this step's statement, an empty /tests of
        # its own, the gate read-only; never the steps' results.
        assert seen["/demo"]["name"] == "agent-program"
        assert keys_of(pod_spec, "agent-program") == {"episode.py", "tasks-agent.json"}
        assert keys_of(pod_spec, seen["/rollout-step"]["name"]) == {f"step-{number}-agent.json"}
        assert seen["/tests"]["name"] == f"step-{number}-agent-tests"
        assert seen["/rollout-gate"]["readOnly"] is True
        assert "/rollout-steps" not in seen
        assert seen["/handoff"].get("readOnly") is not True
    text = {key: data[key] for key in ("tasks-agent.json", "step-1-agent.json")}
    for key, held in text.items():
        assert enc(second["statement"]) not in held, key  # no later statement
        for step in (first, second):
            for name, body in step["tests"].items():
                assert enc(body) not in held, (key, name)
        assert "the plain task's hidden check" not in held
    assert enc(first["statement"]) in data["step-1-agent.json"]
    assert enc(second["statement"]) in data["step-2-agent.json"]
    assert enc(first["statement"]) not in data["step-2-agent.json"]
    # A command agent holds no solution; the oracle's step file holds its own step's.
    assert "solution" not in orjson.loads(data["step-1-agent.json"])["two-steps"]
    oracle = configmap_manifest(batch([steps_task()]), "program")["data"]
    step_1 = orjson.loads(oracle["step-1-agent.json"])["two-steps"]
    assert step_1["solution"] == first["solution"] and "tests" not in step_1
    assert enc(second["solution"]["solve.sh"]) not in oracle["step-1-agent.json"]


def test_each_grader_holds_its_own_steps_tests_and_the_results_no_agent_mounts():
    spec = batch([steps_task(), HIDDEN], agent={"command": ["python", "-c", "pass"]})
    pod_spec = pod_spec_of(spec)
    data = configmap_manifest(spec, "program")["data"]
    first, second = steps_task()["steps"]
    grader = pod_spec["initContainers"][1]
    seen = mounts(grader)
    assert seen["/demo"]["name"] == "step-program"
    assert keys_of(pod_spec, "step-program") == {"episode.py", "tasks-steps-grader.json"}
    assert keys_of(pod_spec, seen["/rollout-step"]["name"]) == {"step-1-tests.json"}
    assert seen["/tests"]["name"] == "agent-tests" and seen["/handoff"]["readOnly"] is True
    assert seen["/rollout-steps"].get("readOnly") is not True
    assert seen["/rollout-gate"].get("readOnly") is not True
    # Its tasks file and step file: step 1's tests only, no statement; no other's tests.
    assert orjson.loads(data["step-1-tests.json"])["two-steps"]["tests"] == first["tests"]
    assert enc(first["statement"]) not in data["step-1-tests.json"]
    assert enc(second["tests"]["test.sh"]) not in data["step-1-tests.json"]
    for held in (data["tasks-steps-grader.json"],):
        assert "the plain task's hidden check" not in held
        assert enc(second["tests"]["test.sh"]) not in held
        assert enc(second["statement"]) not in held
    # The Pod's container grades the last step (and a task without steps) as before.
    main = mounts(pod_spec["containers"][0])
    assert main["/demo"]["name"] == "program"
    assert keys_of(pod_spec, main["/rollout-step"]["name"]) == {"step-2-tests.json"}
    # The steps' results: no agent container mounts that volume.
    holders = [
        c["name"]
        for c in [*pod_spec["initContainers"], *pod_spec["containers"]]
        if any(m["name"] == "step-state" for m in c["volumeMounts"])
    ]
    assert holders == ["grade-1", "episode"]


def test_a_batch_without_steps_keeps_its_pod():
    command = {"command": ["python", "-c", "pass"]}
    (agent,) = pod_spec_of(batch([HIDDEN], agent=command))["initContainers"]
    assert agent["name"] == "agent" and "ROLLOUT_STEP" not in env(agent)


def test_a_failed_later_steps_agent_ends_the_episode_and_every_log_is_read():
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    failed = pod("rollout-0-x", "2026-11-30T10:00:00Z", phase="Failed")
    status = failed["status"]
    done = {"terminated": {"exitCode": 0, "startedAt": "2026-11-30T10:00:02Z"}}
    status["initContainerStatuses"] = [
        {"name": "agent", "state": done},
        {"name": "grade-1", "state": done},
        {"name": "agent-2", "state": {"terminated": {"exitCode": 3, "message": "x"}}},
    ]
    status["containerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    obs = observe_pods(handle, 0, {"a": failed})
    assert (obs.phase, obs.exit_code, obs.termination_message) == ("Failed", 3, "x")
    assert obs.log_containers == ["agent", "grade-1", "agent-2", "episode"]
    assert obs.timing["container_started_at"] == obs.created_at + 2


def test_each_steps_container_references_the_env_tables_its_runner_hands_on():
    """An agent's container the agent's tables ([environment.env], the oracle's
    [solution.env]); a grader's the tests' ([verifier.env]) too."""
    tables = {"environment": {"E": "${HOST_E}"}, "verifier": {"V": "${HOST_V}"}}
    pod_spec = pod_spec_of(batch([steps_task() | {"env": tables}]))
    refs = {
        c["name"]: {
            e["name"] for e in c["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        }
        for c in [*pod_spec["initContainers"], *pod_spec["containers"]]
    }
    agent_refs = {n for n in refs["agent"] if "HOST_E" in n}
    assert agent_refs and refs["agent"] == refs["agent-2"] == agent_refs
    assert refs["grade-1"] == refs["episode"] and any("HOST_V" in n for n in refs["grade-1"])
    # Nor does an agent's tasks file hold the tests' table (a grader's does).
    data = configmap_manifest(batch([steps_task() | {"env": tables}]), "program")["data"]
    assert "HOST_V" not in data["tasks-agent.json"] and "HOST_E" in data["tasks-agent.json"]
    assert "HOST_V" in data["tasks-steps-grader.json"]

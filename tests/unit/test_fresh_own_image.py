"""`grade: fresh` on Kubernetes for a task in its own image, pure parts: the Pod of three
containers of that image (the workspace's seed, the agent, the grader), what each mounts,
what the request refuses, which batches start cold, and the runner's seed copy."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import parse_spec
from rollout_worker.backends import warm
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube.backend import KubernetesBackend
from rollout_worker.backends.kube.objects import configmap_manifest, job_manifest, job_parts
from rollout_worker.backends.kube.read import observe_pods
from rollout_worker.sandbox import episode_program_text as program

IMAGE = "rollout.local/task:1"
OWN = {
    "id": "own",
    "statement": "Fix greet.py.",
    "files": {"greet.py": "x = 1\n"},
    "image": IMAGE,
    "workdir": "/app",
    "tests": {"test.sh": "exit 0  # the hidden check\n"},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
    "grade": "fresh",
    "agent": {"command": ["python", "-c", "pass"]},
}


def real_spec(tasks, backend="kubernetes", **more):
    return parse_spec(
        {
            "backend": backend,
            "tasks": tasks,
            "policy": {"url": "http://10.0.0.5:8000"},
            "infra_retries": 1,
            **more,
        },
        max_episodes=100,
    )


def pod_of(batch, image=IMAGE):
    part = next(p for p in job_parts(batch) if p.image == image)
    return job_manifest(batch, ttl_seconds_after_finished=60, part=part)["spec"]["template"]


def mounts(container):
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def env(container):
    return {e["name"]: e.get("value") for e in container["env"]}


def test_a_fresh_task_in_its_own_image_seeds_its_workspace_then_runs_agent_and_grader_apart():
    template = pod_of(real_spec([OWN]))
    pod = template["spec"]
    seed, agent = pod["initContainers"]
    (grader,) = pod["containers"]
    assert [c["name"] for c in (seed, agent, grader)] == ["seed", "agent", "episode"]
    # Each a fresh container of the task's image, with today's isolation and limits.
    for container in (seed, agent, grader):
        assert container["image"] == IMAGE
        assert container["securityContext"] == grader["securityContext"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["resources"] == grader["resources"]
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"]
    assert pod["automountServiceAccountToken"] is False
    # The seed: the runner's seed phase copies the image's workdir into the workspace volume.
    assert seed["command"] == ["python", "-B", "/demo/episode.py"]
    assert env(seed) == {
        "EPISODE_ID": None,  # the Pod's name
        "ROLLOUT_PHASE": "seed",
        "ROLLOUT_SEED_FROM": "/app",
        "ROLLOUT_SEED_TO": "/rollout-seed",
    }
    assert mounts(seed) == {"/demo": "agent-program", "/rollout-seed": "workspace"}
    assert seed["workingDir"] == "/" and "startupProbe" not in seed
    # The agent and the grader work in that volume, at the workdir.
    for container in (agent, grader):
        assert mounts(container)["/app"] == "workspace"
        assert container["workingDir"] == "/app" and env(container)["ROLLOUT_WORKSPACE"] == "/app"
        assert "/workspace" not in mounts(container)
    # Only the workspace and the baseline's hand-off cross from the agent to the grader: the
    # agent's /tmp, /logs and /solution are volumes of its own; the Pod's /dev/shm is emptied.
    shared = set(mounts(agent).values()) & set(mounts(grader).values())
    assert shared == {"workspace", "handoff"}
    assert {mounts(agent)[p] for p in ("/tmp", "/logs", "/solution")} == {
        "tmp-of-agent",
        "agent-logs-of-agent",
        "agent-solution-of-agent",
    }
    assert env(grader)["ROLLOUT_SHARED_DIRS"] == "/dev/shm"
    assert env(grader)["ROLLOUT_PHASE"] == "grade" and env(agent)["ROLLOUT_GRADER"] == "sandbox"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tmp-of-agent"] == volumes["tmp"] | {"name": "tmp-of-agent"}
    assert all(v["emptyDir"].get("sizeLimit") for v in volumes.values() if "emptyDir" in v)
    # The hidden tests reach the grader alone: neither the seed nor the agent mounts them.
    for container in (seed, agent):
        assert "/tests" not in mounts(container)
        assert mounts(container)["/demo"] == "agent-program"
    items = {i["key"] for i in volumes["agent-program"]["configMap"]["items"]}
    assert items == {"episode.py", "tasks-agent.json"}
    assert mounts(grader)["/demo"] == "program" and mounts(grader)["/tests"] == "agent-tests"
    data = configmap_manifest(real_spec([OWN]), "program")["data"]
    assert "the hidden check" not in data["tasks-agent.json"]
    # No stash: the runner that holds the tests is the grader's.
    assert "ROLLOUT_HIDDEN_TASKS_FILE" not in env(grader) | env(agent)
    # Every container's exit code counts under the retry budget's rules.
    rules = job_manifest(real_spec([OWN]), ttl_seconds_after_finished=60)["spec"]
    named = {
        r["onExitCodes"]["containerName"]
        for r in rules["podFailurePolicy"]["rules"]
        if "onExitCodes" in r
    }
    assert named == {"seed", "agent", "episode"}


def test_the_same_task_graded_same_keeps_its_pod_as_before():
    pod = pod_of(real_spec([OWN | {"grade": "same"}]))["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["stash"]
    (episode,) = pod["containers"]
    assert mounts(episode)["/workspace"] == "workspace" and "/app" not in mounts(episode)


def test_the_request_refuses_what_such_a_pod_cannot_grade():
    with pytest.raises(InvalidSpec, match="needs its workdir"):
        real_spec([{k: v for k, v in OWN.items() if k != "workdir"}])
    with pytest.raises(InvalidSpec, match="grade one way"):
        real_spec([OWN, OWN | {"id": "own-same", "grade": "same"}])
    # Another image's tasks are their own Job: they may grade either way.
    other = OWN | {"id": "other", "image": "rollout.local/other:1", "grade": "same"}
    batch = real_spec([OWN, other])
    assert [
        c["name"] for c in pod_of(batch, "rollout.local/other:1")["spec"]["initContainers"]
    ] == ["stash"]
    # Locally the grader's sandbox is the image's again: no workdir needed there.
    local = {k: v for k, v in OWN.items() if k != "workdir"}
    assert real_spec([local], backend="local").tasks[0]["grade"] == "fresh"


def test_such_a_batch_starts_cold_and_other_batches_keep_their_pool_keys():
    backend = types.SimpleNamespace(program=program())
    assert KubernetesBackend.pool_key(backend, real_spec([OWN], infra_retries=0)) is None
    same = real_spec([OWN | {"grade": "same"}], infra_retries=0)
    key = KubernetesBackend.pool_key(backend, same)
    assert key is not None
    assert key == warm.pool_key(same, program(), grades_within=True)


def test_a_seed_that_failed_ends_the_episode():
    handle = KubeRunHandle(
        backend="kubernetes", batch_id="b", origin=0.0, episode_prefix="rollout", context="c"
    )
    failed = {
        "metadata": {"name": "rollout-0-x", "creationTimestamp": "2026-11-30T10:00:00Z"},
        "spec": {"restartPolicy": "Never"},
        "status": {
            "phase": "Failed",
            "initContainerStatuses": [
                {"name": "seed", "state": {"terminated": {"exitCode": 3, "message": "no /app"}}},
                {"name": "agent", "state": {"waiting": {"reason": "PodInitializing"}}},
            ],
            "containerStatuses": [
                {"name": "episode", "state": {"waiting": {"reason": "PodInitializing"}}}
            ],
        },
    }
    obs = observe_pods(handle, 0, {"a": failed})
    assert (obs.phase, obs.exit_code, obs.termination_message) == ("Failed", 3, "no /app")
    # Its log, with the error event, comes first; a seed that succeeded is not read.
    assert obs.log_containers == ["seed", "agent", "episode"]
    seeded = failed["status"]["initContainerStatuses"][0]["state"]["terminated"]
    seeded["exitCode"] = 0
    assert observe_pods(handle, 0, {"a": failed}).log_containers == ["agent", "episode"]


def test_the_seed_copies_the_images_folder_as_the_local_backend_copies_a_workspace(tmp_path):
    """Folders, files (modes without setuid, times), links as links; never a FIFO or socket;
    a link to a folder is not followed. Run through the built episode program."""
    image = tmp_path / "app"
    (image / "pkg").mkdir(parents=True)
    (image / "pkg" / "mod.py").write_text("x = 1\n")
    (image / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(image / "run.sh", 0o4755)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host\n")
    os.symlink(outside, image / "out")
    os.symlink("pkg/mod.py", image / "rel")
    os.mkfifo(image / "fifo")
    os.utime(image / "pkg" / "mod.py", (1_000_000, 1_000_000))
    dest = tmp_path / "volume"
    dest.mkdir()
    script = tmp_path / "episode.py"
    script.write_text(program())
    variables = {"ROLLOUT_PHASE": "seed", "ROLLOUT_SEED_FROM": str(image)}
    run = subprocess.run(
        [sys.executable, "-B", str(script)],
        env={"PATH": os.environ["PATH"], **variables, "ROLLOUT_SEED_TO": str(dest)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "skipped 1 (special file 'fifo')" in run.stderr
    assert (dest / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert (dest / "pkg" / "mod.py").stat().st_mtime == 1_000_000
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert os.readlink(dest / "out") == str(outside) and not (dest / "secret").exists()
    assert os.readlink(dest / "rel") == "pkg/mod.py"
    assert not os.path.lexists(dest / "fifo")
    assert sorted(os.listdir(dest)) == ["out", "pkg", "rel", "run.sh"]
    # An image without the folder: the task's error (exit 3), nothing copied.
    missing = subprocess.run(
        [sys.executable, "-B", str(script)],
        env={
            "PATH": os.environ["PATH"],
            "EPISODE_ID": "rollout-0-x",
            "ROLLOUT_PHASE": "seed",
            "ROLLOUT_SEED_FROM": str(tmp_path / "nowhere"),
            "ROLLOUT_SEED_TO": str(tmp_path / "volume"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 3
    (event,) = [json.loads(line) for line in missing.stdout.splitlines()]
    assert (event["event"], event["kind"]) == ("error", "episode")
    assert "nowhere' is not a folder: No such file or directory" in event["cause"]


def test_the_seed_stops_at_its_entry_cap(tmp_path, monkeypatch):
    from rollout_worker.sandbox.runner import seed as seeding

    image = tmp_path / "app"
    image.mkdir()
    for n in range(5):
        (image / f"f{n}").write_text("x")
    dest = tmp_path / "volume"
    dest.mkdir()
    monkeypatch.setattr(seeding, "SEED_MAX_ENTRIES", 3)
    assert seeding.seed(str(image), str(dest)) == 0
    assert len(os.listdir(dest)) == 3

"""`rollout tasks check` for real on the local backend: the command builds the image task with
Docker, starts its own redis-server and Celery workers, runs every oracle and the nop in real
bubblewrap sandboxes, and judges the fixtures (tests/data/harbor/README.md says which fail and
why). And `rollout tasks build` against a real `docker build` whose FROM cannot be pulled."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.workers]

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / "tests" / "data" / "harbor"
BASE_IMAGE = "rollout.local/python:3-bookworm"  # image-task's FROM (the fixtures' README)
# Files only, a task in its own image, and a task per honoured key of task.toml (the fixtures'
# README says which key each one shows). Each must pass: oracle 1, nop 0.
GOOD = (
    "add-numbers",
    "image-task",
    "workdir-task",
    "separate-grader",
    "env-tables",
    "healthcheck",
    "artifacts",
    "limits",
    "no-network",
)


def rollout(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout_worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def docker() -> None:
    """A Docker engine with image-task's base (loaded from hack/images' cache when missing)."""
    subprocess.run([str(ROOT / "hack" / "docker-up.sh")], check=True, timeout=900)
    have = subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True)
    if have.returncode != 0:
        made = subprocess.run(
            [str(ROOT / "hack" / "images" / "build.sh"), "python"],
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
        )
        subprocess.run(["docker", "load", "-i", made.stdout.split()[-1]], check=True, timeout=300)


@pytest.fixture
def rootfs():
    # The sandboxes run as another host user: pytest's own folders are closed to it.
    folder = Path(tempfile.mkdtemp(prefix="rollout-test-check-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def table_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    assert lines[0].split() == ["TASK", "ORACLE", "NOP", "SECONDS", "RESULT", "CAUSE"], stdout
    rows = {}
    for line in lines[1:-1]:
        words = line.split(maxsplit=5)
        if words[1] == "no":  # "no oracle" is one cell
            words = [words[0], "no oracle", *line.split(maxsplit=6)[3:]]
        rows[words[0]] = words
    return rows


def test_check_runs_every_oracle_and_nop_and_fails_the_task_set_with_each_cause(docker, rootfs):
    started = time.monotonic()
    done = rollout("tasks", "check", str(HARBOR), "--nop", "--rootfs", str(rootfs))
    seconds = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    for good in GOOD:
        assert rows[good][1:3] == ["1", "0"] and rows[good][4:] == ["ok"], rows[good]
    assert rows["wrong-oracle"][1:3] == ["0", "0"]
    assert rows["wrong-oracle"][4:] == [
        "FAIL",
        "oracle scored 0 (reward_file); solve.sh's last line: 'nothing to fix'",
    ]
    assert rows["partial-credit"][1:3] == ["1", "0.5"]
    assert rows["partial-credit"][5] == "nop scored 0.5: the tests reward an untouched task"
    assert rows["no-solution"][1:3] == ["no oracle", "0"]
    assert rows["no-solution"][4] == "FAIL"
    summary = done.stdout.splitlines()[-1]
    # Other fixtures may join the folder: only these are named here.
    failed = summary.partition(" failed (")[2].partition(")")[0].split(", ")
    assert {"no-solution", "partial-credit", "wrong-oracle"} <= set(failed), summary
    assert not set(GOOD) & set(failed), summary
    assert "image-task: rootfs " in done.stderr  # built and exported for the local backend
    # About 10 s on an idle machine, 30 s under load (Docker build cached, rootfs exported once;
    # twelve tasks in two batches side by side); bounded loosely so a busy machine does not
    # fail it, tightly enough to catch one batch per task.
    assert seconds < 60, f"the check took {seconds:.1f}s"

    # The same command passes (exit 0) on the tasks whose oracle is right and whose tests
    # reward nothing untouched; the rootfs is not exported again.
    only = ["--task", "add-numbers", "--task", "image-task"]
    done = rollout("tasks", "check", str(HARBOR), "--nop", "--rootfs", str(rootfs), *only)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "2 tasks: 2 passed"
    assert "(already there)" in done.stderr


def test_check_judges_the_multi_step_fixtures_on_the_local_backend():
    # tests/data/harbor/multi-step (a folder of its own: its README): each step's solve.sh
    # in turn earns the oracle 1; the nop does nothing at each step, so make-file scores 0,
    # under its min_reward: the episode ends there, reward 0.
    done = rollout("tasks", "check", str(HARBOR / "multi-step"), "--nop")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert rows["two-steps"][1:3] == ["1", "0"] and rows["two-steps"][4:] == ["ok"], rows
    assert done.stdout.splitlines()[-1] == "1 task: 1 passed"


@pytest.mark.k8s
@pytest.mark.k8s_real
def test_check_judges_the_multi_step_fixtures_on_the_real_node(real_node, real_stack):
    # The same judgement from Pods: each step's agent and tests in containers of their own.
    flags = [f for f in real_node.run_flags() if f not in ("--backend", "kubernetes")]
    done = rollout(
        *("tasks", "check", str(HARBOR / "multi-step"), "--nop", "--backend", "kubernetes"),
        *(*flags, "--capacity-check", "warn", "--redis-url", real_stack.redis_url),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert rows["two-steps"][1:3] == ["1", "0"] and rows["two-steps"][4:] == ["ok"], rows
    assert done.stdout.splitlines()[-1] == "1 task: 1 passed"


def test_build_names_the_base_image_docker_could_not_get_and_how_to_provide_it(docker, tmp_path):
    task = tmp_path / "tasks" / "unreachable-base"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text('version = "1.0"\n')
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    # A multi-stage Dockerfile: a local base, and an ARG-named one no registry here serves.
    (task / "environment" / "Dockerfile").write_text(
        "ARG TOOLS=registry.invalid/team/tools:1\n"
        f"FROM {BASE_IMAGE} AS base\n"
        "FROM ${TOOLS} AS tools\n"
        "FROM base\n"
        "COPY --from=tools /bin/true /true\n"
    )
    done = rollout("tasks", "build", str(tmp_path / "tasks"), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("error: unreachable-base: docker build of rollout.local/harbor-")
    assert (
        "cannot get its base image registry.invalid/team/tools:1 (not in the local Docker"
        in (lines[0])
    )
    assert BASE_IMAGE not in lines[0]  # it is local: not what is missing
    assert lines[1] == (
        "  provide registry.invalid/team/tools:1: `docker tag <an image you have> "
        "registry.invalid/team/tools:1`, or `docker load -i` a saved copy, or make "
        "registry.invalid reachable (`docker login registry.invalid` if it asks)"
    )
    assert len(lines) == 2  # no build log


@pytest.mark.k8s
@pytest.mark.k8s_real
def test_check_judges_the_same_task_set_on_the_real_node(docker, real_node, real_stack):
    # The image task built and put on the node, the rest in the node's Python image; every
    # oracle and nop in real Pods through the workers at --redis-url.
    flags = [f for f in real_node.run_flags() if f not in ("--backend", "kubernetes")]
    done = rollout(
        *("tasks", "check", str(HARBOR), "--nop", "--backend", "kubernetes", "--node-import"),
        *(*flags, "--capacity-check", "warn", "--redis-url", real_stack.redis_url),
        timeout=600,
    )
    assert done.returncode == 1 and done.stdout, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    for good in GOOD:
        assert rows[good][1:3] == ["1", "0"] and rows[good][4:] == ["ok"], rows[good]
    assert rows["wrong-oracle"][1:3] == ["0", "0"] and rows["wrong-oracle"][4] == "FAIL"
    assert rows["partial-credit"][1:3] == ["1", "0.5"]
    assert rows["no-solution"][1:3] == ["no oracle", "0"]

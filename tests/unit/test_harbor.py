"""Harbor task folders as tasks (rollout_wire.harbor), their task sets, and `rollout tasks`'s
commands (built as argv lists: nothing here runs Docker)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from rollout_wire.errors import InvalidSpec
from rollout_wire.harbor import (
    MAX_FILE_BYTES,
    environment_digest,
    harbor_images,
    is_harbor_folder,
    load_harbor_tasks,
    local_image_name,
    task_id_of,
)
from rollout_wire.request import REWARD_FILES, parse_spec
from rollout_wire.tasksets import load_task_set
from rollout_worker.cli import base_images as cli_base
from rollout_worker.cli import image_build as cli_build
from rollout_worker.cli import image_commands as cli_argv
from rollout_worker.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "data" / "harbor"
POLICY = {"url": "http://127.0.0.1:8000", "model": "m"}


def make_task(
    root: Path,
    name: str,
    *,
    toml: str = 'version = "1.0"\n',
    instruction: str | None = "Fix it.\n",
    environment: dict[str, str | bytes] | None = None,
    tests: dict[str, str] | None = None,
    solution: dict[str, str] | None = None,
) -> Path:
    """A Harbor task folder: files given as text (or bytes)."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    if instruction is not None:
        (folder / "instruction.md").write_text(instruction)
    trees = {
        "environment": environment if environment is not None else {"app.py": "x = 1\n"},
        "tests": tests
        if tests is not None
        else {"test.sh": "echo 1 > /logs/verifier/reward.txt\n"},
        "solution": solution,
    }
    for sub, files in trees.items():
        for rel, content in (files or {}).items():
            path = folder / sub / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
    return folder


def refusal(path: Path, only: list[str] | None = None) -> str:
    with pytest.raises(InvalidSpec) as info:
        load_harbor_tasks(path, only)
    return " | ".join(info.value.problems)


# tests/data/harbor's tasks, in folder order (its README says what each is for).
FIXTURE_IDS = [
    "add-numbers",
    "artifacts",
    "env-tables",
    "healthcheck",
    "image-task",
    "limits",
    "no-network",
    "no-solution",
    "partial-credit",
    "separate-grader",
    "workdir-task",
    "wrong-oracle",
]


# -- the mapping -------------------------------------------------------------------------------


def test_the_fixture_folder_maps_each_harbor_task_to_one_of_ours():
    tasks = {t["id"]: t for t in load_harbor_tasks(FIXTURES)}
    assert list(tasks) == FIXTURE_IDS
    for task in tasks.values():
        assert task["test_command"] == ["bash", "/tests/test.sh"]
        assert task["reward"] == "file" and task["baseline"] is False
        assert "test.sh" in task["tests"]

    add = tasks["add-numbers"]
    # The leading canary comment is not part of what the policy sees.
    assert add["statement"].startswith("`add(a, b)` in `calc.py`")
    assert add["files"] == {"calc.py": "def add(a, b):\n    return a - b\n"}
    assert set(add["tests"]) == {"test.sh", "check_add.py"}
    assert set(add["solution"]) == {"solve.sh"}
    assert add["time_limit_seconds"] == 30
    assert add["description"] == "difficulty: easy; category: programming; tags: python, bugfix"
    assert "image" not in add

    partial = tasks["partial-credit"]
    assert partial["time_limit_seconds"] == 46  # 45.5 rounded up
    assert partial["description"].startswith("Four small text helpers")
    assert partial["description"].endswith("difficulty: medium; tags: python, partial-credit")

    image = tasks["image-task"]
    assert re.fullmatch(r"rollout\.local/harbor-image-task:[0-9a-f]{12}", image["image"])
    assert image["image"] == local_image_name("image-task", FIXTURES / "image-task" / "environment")
    assert image["files"] == {}  # the image holds the workspace

    assert "solution" not in tasks["no-solution"]

    # A fixture per honoured key (tests/data/harbor/README.md): each carries it as mapped.
    assert tasks["env-tables"]["env"]["solution"] == {
        "HINT": "${ROLLOUT_FIXTURE_HINT:-oracle-only}",
        "BOTH": "from-solution",
    }
    assert set(tasks["env-tables"]["env"]) == {"environment", "verifier", "solution"}
    health = tasks["healthcheck"]
    assert health["grade"] == "fresh"
    assert health["healthcheck"]["start_period_seconds"] == 10.0
    assert health["healthcheck"]["retries"] == 1
    assert tasks["artifacts"]["artifacts"] == ["report.txt", "/logs/agent"]
    assert tasks["limits"]["time_limit_seconds"] == 30
    assert tasks["limits"]["test_timeout_seconds"] == 20


def test_a_single_task_folder_is_a_task_set_of_one():
    (single,) = load_harbor_tasks(FIXTURES / "add-numbers")
    assert single == next(t for t in load_harbor_tasks(FIXTURES) if t["id"] == "add-numbers")
    assert is_harbor_folder(FIXTURES) and is_harbor_folder(FIXTURES / "add-numbers")


def test_what_is_not_a_harbor_folder(tmp_path):
    assert not is_harbor_folder(tmp_path)
    assert not is_harbor_folder(tmp_path / "missing")
    assert not is_harbor_folder(FIXTURES / "README.md")
    assert "no task.toml" in refusal(tmp_path)
    assert "no such folder" in refusal(tmp_path / "missing")


@pytest.mark.parametrize(
    ("name", "task_id"),
    [
        ("add-numbers", "add-numbers"),
        ("My Task (v2)", "my-task-v2"),
        ("Hello_World.v1", "hello_world.v1"),
        ("--x--", "x"),
        ("!!!", ""),
        ("a" * 70 + "-b", "a" * 63),
    ],
)
def test_a_folder_name_becomes_a_valid_task_id(name, task_id):
    assert task_id_of(name) == task_id


def test_folders_that_map_to_the_same_id_are_refused_naming_both(tmp_path):
    make_task(tmp_path, "Fix Bug")
    make_task(tmp_path, "fix-bug")
    assert refusal(tmp_path) == (
        "task folders 'Fix Bug', 'fix-bug' all map to task id 'fix-bug': rename one"
    )


def test_every_unsupported_or_broken_task_is_listed_at_once(tmp_path):
    make_task(tmp_path, "good")
    make_task(tmp_path, "compose", environment={"docker-compose.yaml": "services: {}\n"})
    make_task(tmp_path, "steps", toml='[[steps]]\nname = "one"\n')
    make_task(tmp_path, "binary", environment={"data.bin": b"\x00\x01\x02"})
    make_task(tmp_path, "latin", environment={"notes.txt": "caf\xe9".encode("latin-1")})
    make_task(tmp_path, "huge", environment={"big.txt": "x" * (MAX_FILE_BYTES + 1)})
    make_task(tmp_path, "no-instruction", instruction=None)
    make_task(tmp_path, "no-tests", tests={"run_tests.py": "print()\n"})
    make_task(tmp_path, "bad-toml", toml="version = \n")
    make_task(
        tmp_path, "env-vars", toml='[verifier]\nenv = { OPENAI_API_KEY = "k", B = "x${Y}" }\n'
    )
    make_task(tmp_path, "gpus", toml="[environment]\ngpus = 1\n")
    make_task(tmp_path, "bad-timeout", toml='[agent]\ntimeout_sec = "soon"\n')
    os.symlink("app.py", make_task(tmp_path, "link") / "environment" / "alias.py")
    text = refusal(tmp_path)
    for expected in [
        "task 'compose': environment/docker-compose.yaml (several containers) is not supported",
        # [[steps]] is honoured (rollout_wire.harbor_steps): a step without its folder is not.
        "task 'steps': [[steps]] 1 (one): no steps/one",
        "task 'binary': environment/data.bin is a binary file",
        "task 'latin': environment/notes.txt is a binary file",
        f"task 'huge': environment/big.txt is {MAX_FILE_BYTES + 1} bytes",
        "task 'no-instruction': no instruction.md",
        "task 'no-tests': no tests/test.sh",
        "task 'bad-toml': task.toml is not valid TOML",
        "task 'env-vars': env.verifier: 'OPENAI_API_KEY' is set by the runner",
        "task 'env-vars': env.verifier: B must be text without '${', or a whole ${VAR}",
        "task 'gpus': [environment] gpus = 1: GPUs are not supported",
        "task 'bad-timeout': [agent] timeout_sec must be a positive number",
        "task 'link': environment/alias.py is a symbolic link",
    ]:
        assert expected in text
    assert "'good'" not in text


def test_a_prebuilt_image_is_used_as_it_is_and_nothing_is_built(tmp_path):
    make_task(
        tmp_path,
        "prebuilt",
        toml='[environment]\ndocker_image = "registry.example.com/team/env:1"\n',
        environment={"Dockerfile": "FROM scratch\n"},
    )
    (task,) = load_harbor_tasks(tmp_path)
    assert task["image"] == "registry.example.com/team/env:1" and task["files"] == {}
    assert harbor_images(tmp_path) == []


def test_the_image_tag_follows_the_environment_folder_bytes_and_nothing_else(tmp_path):
    folder = make_task(tmp_path, "t", environment={"Dockerfile": "FROM x\n", "a.txt": "1\n"})
    env = folder / "environment"
    first = environment_digest(env)
    assert environment_digest(env) == first and re.fullmatch(r"[0-9a-f]{12}", first)
    (folder / "instruction.md").write_text("Something else.\n")
    assert environment_digest(env) == first
    (env / "a.txt").write_text("2\n")
    second = environment_digest(env)
    assert second != first
    (env / "a.txt").chmod(0o755)  # COPY keeps the mode: a new image
    assert environment_digest(env) != second
    # Runs of separators in an id are not valid in an image path: one '-' instead.
    assert local_image_name("a._b", env).startswith("rollout.local/harbor-a-b:")


def test_the_builder_gets_the_dockerfile_tasks_only():
    (image,) = harbor_images(FIXTURES)
    assert image[1:] == ("image-task", FIXTURES / "image-task" / "environment")
    assert image[0].startswith("rollout.local/harbor-image-task:")


# -- task sets and the batch request ------------------------------------------------------------


def test_a_harbor_folder_is_a_task_set_and_only_picks_tasks_in_its_order(tmp_path):
    assert [t["id"] for t in load_task_set(str(FIXTURES))] == FIXTURE_IDS
    picked = load_task_set(str(FIXTURES), ["partial-credit", "add-numbers"])
    assert [t["id"] for t in picked] == ["partial-credit", "add-numbers"]
    with pytest.raises(InvalidSpec, match=r"no task\(s\) \['nope'\]"):
        load_task_set(str(FIXTURES), ["nope"])
    with pytest.raises(InvalidSpec, match="a folder without a Harbor task"):
        load_task_set(str(tmp_path))
    # A broken task does not stand in the way of the ones picked.
    make_task(tmp_path, "fine")
    make_task(tmp_path, "broken", instruction=None)
    assert [t["id"] for t in load_task_set(str(tmp_path), ["fine"])] == ["fine"]
    with pytest.raises(InvalidSpec, match=r"no instruction\.md"):
        load_task_set(str(tmp_path))


def test_the_mapped_tasks_are_a_valid_batch():
    tasks = load_task_set(str(FIXTURES))
    spec = parse_spec({"tasks": tasks, "policy": POLICY}, max_episodes=1000)
    assert {t["id"] for t in spec.tasks} == {t["id"] for t in tasks}
    assert [t.get("image") is not None for t in spec.tasks].count(True) == 1
    assert "/logs/verifier/reward.txt" in REWARD_FILES  # what the fixtures' tests write


def test_the_oracle_runs_tasks_with_a_solution_and_refuses_the_one_without_naming_it():
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": load_task_set(str(FIXTURES)), "agent": "oracle"}, max_episodes=100)
    assert info.value.problems == ["task 'no-solution': the oracle agent needs solution/solve.sh"]
    solvable = load_task_set(str(FIXTURES), ["add-numbers", "partial-credit", "image-task"])
    spec = parse_spec({"tasks": solvable, "agent": "oracle"}, max_episodes=100)
    assert all(t["agent"] == "oracle" for t in spec.tasks)


# -- the fixtures' own scripts (the Docker-free ones, paths moved under a scratch folder) -------


def run_fixture(task: str, scratch: Path, solve: bool) -> dict:
    """The task's tests (after its solution when `solve`) with /tests, /solution and
    /logs/verifier moved under `scratch`; the reward file's content."""
    source = FIXTURES / task
    workspace = scratch / "workspace"
    shutil.copytree(source / "environment", workspace)
    moves = {"/tests/": f"{scratch}/tests/", "/logs/verifier": f"{scratch}/logs/verifier"}
    for sub in ("tests", "solution"):
        if (source / sub).is_dir():
            shutil.copytree(source / sub, scratch / sub)
            for path in (scratch / sub).iterdir():
                text = path.read_text()
                for old, new in moves.items():
                    text = text.replace(old, new)
                path.write_text(text)
    if solve:
        subprocess.run(["bash", f"{scratch}/solution/solve.sh"], cwd=workspace, check=True)
    subprocess.run(["bash", f"{scratch}/tests/test.sh"], cwd=workspace, check=True)
    (reward,) = (scratch / "logs" / "verifier").iterdir()
    text = reward.read_text()
    return json.loads(text) if reward.suffix == ".json" else {"reward": float(text)}


@pytest.mark.skipif(shutil.which("python3") is None, reason="the fixtures' tests use python3")
@pytest.mark.parametrize(
    ("task", "before", "after"),
    [("add-numbers", 0.0, 1.0), ("partial-credit", 0.5, 1.0), ("no-solution", 0.0, None)],
)
def test_the_fixture_tests_fail_first_and_the_solution_passes_them(tmp_path, task, before, after):
    assert run_fixture(task, tmp_path / "before", solve=False)["reward"] == before
    if after is not None:
        result = run_fixture(task, tmp_path / "after", solve=True)
        assert result["reward"] == after
        if task == "partial-credit":
            assert result == {"reward": 1.0, "checks_passed": 4, "checks_total": 4}


# -- `rollout tasks build`: the commands ---------------------------------------------------------


def test_the_containerd_socket_is_the_one_hack_localkube_names():
    assert cli_argv.containerd_socket({}) == "/run/rollout-containerd2/containerd.sock"
    assert cli_argv.containerd_socket({"ROLLOUT_LOCALKUBE_NODE_ID": "0"}) == (
        "/run/rollout-containerd2/containerd.sock"
    )
    assert cli_argv.containerd_socket({"ROLLOUT_LOCALKUBE_NODE_ID": "3"}) == (
        "/run/rollout-containerd2-3/containerd.sock"
    )
    assert cli_argv.containerd_socket({"ROLLOUT_NODE_CONTAINERD_STATE": "/srv/ctd"}) == (
        "/srv/ctd/containerd.sock"
    )
    with pytest.raises(ValueError, match=r"0\.\.200"):
        cli_argv.containerd_socket({"ROLLOUT_LOCALKUBE_NODE_ID": "x"})
    # The scripts say the same (a change there must change the function).
    node_sh = (ROOT / "hack" / "localkube" / "node.sh").read_text()
    assert (
        'CONTAINERD_STATE="${ROLLOUT_NODE_CONTAINERD_STATE:-/run/rollout-containerd2${NODE_SUFFIX}}"'
        in node_sh
    )
    assert 'CONTAINERD_SOCK="${CONTAINERD_STATE}/containerd.sock"' in node_sh
    assert '((NODE_ID == 0)) || NODE_SUFFIX="-${NODE_ID}"' in node_sh
    assert '"${CTR_BIN}" --address "${CONTAINERD_SOCK}" --namespace k8s.io' in node_sh


def test_the_build_import_push_and_rootfs_commands():
    image = "rollout.local/harbor-t:0123456789ab"
    assert cli_argv.build_argv(image, Path("/x/env")) == ["docker", "build", "-t", image, "/x/env"]
    assert cli_argv.node_import_argvs(image, "/run/c.sock") == (
        ["docker", "save", image],
        ["ctr", "--address", "/run/c.sock", "--namespace", "k8s.io", "images", "import", "-"],
    )
    target = cli_argv.pushed_name(image, "registry.example.com:5000/team/")
    assert target == "registry.example.com:5000/team/harbor-t:0123456789ab"
    assert cli_argv.push_argvs(image, target) == [
        ["docker", "tag", image, target],
        ["docker", "push", target],
    ]
    for bad in ("https://registry.example.com", "", "/", "a b"):
        with pytest.raises(ValueError, match="without a scheme"):
            cli_argv.check_registry(bad)
    assert cli_argv.rootfs_dirname(image) == "rollout.local_harbor-t_0123456789ab"
    assert cli_argv.create_argv(image)[:3] == ["docker", "create", image]
    export, extract = cli_argv.export_argvs("c0ffee", Path("/r/img"))
    assert export == ["docker", "export", "c0ffee"]
    assert extract[:6] == ["tar", "-x", "-f", "-", "-C", "/r/img"]
    assert "--exclude=dev/*" in extract
    assert cli_argv.remove_argv("c0ffee") == ["docker", "rm", "-f", "c0ffee"]
    assert cli_argv.image_id_argv(image)[-1] == image


def test_a_plan_runs_each_image_through_build_then_import_push_and_rootfs():
    images = [
        ("rollout.local/harbor-a:1", "a", Path("/a")),
        ("rollout.local/harbor-b:2", "b", Path("/b")),
    ]
    steps = cli_argv.plan(images, node_socket="/s.sock", registry="reg:5000", rootfs=Path("/r"))
    assert [(s.task_id, s.argv[1]) for s in steps][:7] == [
        ("a", "build"),
        ("a", "save"),
        ("a", "tag"),
        ("a", "push"),
        ("a", "create"),
        ("a", "export"),
        ("a", "rm"),
    ]
    assert len(steps) == 14
    assert steps[1].text() == (
        "docker save rollout.local/harbor-a:1 | ctr --address /s.sock --namespace k8s.io images "
        "import -"
    )
    only_build = cli_argv.plan(images, node_socket=None, registry=None, rootfs=None)
    assert [s.argv[1] for s in only_build] == ["build", "build"]


def test_the_base_images_of_a_dockerfile_and_how_a_missing_one_is_recognised():
    dockerfile = (
        "# comment\n"
        "FROM --platform=linux/amd64 rollout.local/python:3-bookworm AS deps\n"
        "RUN true\n"
        "from deps AS final\n"
        "FROM busybox\n"
    )
    assert cli_base.dockerfile_bases(dockerfile) == ["rollout.local/python:3-bookworm", "busybox"]
    assert cli_base.dockerfile_bases((FIXTURES / "image-task/environment/Dockerfile").read_text())
    for output in [
        "ERROR: failed to solve: rollout.local/python:3-bookworm: failed to resolve source "
        "metadata for rollout.local/python:3-bookworm: failed to do request: Head "
        '"https://rollout.local/v2/python/manifests/3-bookworm": dial tcp: lookup rollout.local: '
        "no such host",
        "pull access denied for nosuch, repository does not exist or may require 'docker login'",
        "Error response from daemon: manifest for busybox:nope not found: manifest unknown",
    ]:
        assert cli_base.missing_base(output)
    assert not cli_base.missing_base("RUN pip install x: exit code: 1")
    assert cli_argv.last_line("step 1\n\nERROR: boom\n\n") == "ERROR: boom"
    assert cli_argv.last_line("") == "(no output)"


# -- `rollout tasks`: the commands ---------------------------------------------------------------


def test_tasks_is_a_command_of_rollout():
    assert "tasks" in CliRunner().invoke(cli, ["--help"]).output


def said(result) -> list[str]:
    """What a command printed, but the task warnings (keys the fixtures state that are not
    enforced here) it lists first."""
    return [line for line in result.output.splitlines() if not line.startswith("warning: ")]


def test_show_prints_one_line_per_task_or_the_tasks_as_json():
    result = CliRunner().invoke(cli, ["tasks", "show", str(FIXTURES)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATEMENT", "WORKSPACE", "TESTS", "SOLUTION", "LIMIT"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == FIXTURE_IDS
    assert "1 file " in rows["add-numbers"] and rows["add-numbers"].endswith("yes       30s")
    assert "image rollout.local/harbor-image-task:" in rows["image-task"]
    assert rows["no-solution"].split()[-2:] == ["no", "20s"]

    result = CliRunner().invoke(
        cli, ["tasks", "show", str(FIXTURES), "--json", "--task", "add-numbers"]
    )
    assert result.exit_code == 0, result.output
    assert orjson.loads(result.stdout) == load_task_set(str(FIXTURES), ["add-numbers"])

    result = CliRunner().invoke(cli, ["tasks", "show", str(FIXTURES), "--task", "nope"])
    assert result.exit_code == 1 and "has no task(s) ['nope']" in result.output


def test_build_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "tasks",
            "build",
            str(FIXTURES),
            "--dry-run",
            "--node-import",
            "--containerd-socket",
            "/s.sock",
            "--push",
            "reg:5000/t",
            "--rootfs",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("docker build -t rollout.local/harbor-image-task:")
    assert lines[0].endswith(str(FIXTURES / "image-task" / "environment"))
    assert any(line.startswith("docker push reg:5000/t/harbor-image-task:") for line in lines)
    assert any(f"-C {tmp_path}/rollout.local_harbor-image-task_" in line for line in lines)
    assert list(tmp_path.iterdir()) == []


def test_build_fails_in_one_line_without_docker_and_has_nothing_to_do_without_dockerfiles(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(cli_build.shutil, "which", lambda name: None)
    result = CliRunner().invoke(cli, ["tasks", "build", str(FIXTURES)])
    assert result.exit_code == 1
    assert said(result) == ["error: docker is not on PATH: install the Docker client (and daemon)"]
    make_task(tmp_path, "plain")
    result = CliRunner().invoke(cli, ["tasks", "build", str(tmp_path)])
    assert result.exit_code == 0 and "nothing to build" in result.output
    result = CliRunner().invoke(cli, ["tasks", "build", str(FIXTURES), "--push", "http://r"])
    assert result.exit_code == 2 and "without a scheme" in result.output


FAKE_DOCKER = """#!/bin/bash
# Stands in for the Docker client: logs its arguments, answers like docker would.
echo "docker $*" >> "$FAKE_LOG"
case "$1" in
  version) echo 27.0.0 ;;
  build)
    if grep -q nosuch "${@: -1}/Dockerfile"; then
      echo "#1 [internal] load metadata for docker.io/library/nosuch:1" >&2
      echo "ERROR: failed to solve: nosuch:1: pull access denied, repository does not exist" >&2
      exit 1
    fi ;;
  save) printf 'an image archive' ;;
  image)
    if [[ "$*" == *nosuch* ]]; then echo "Error: No such image: nosuch:1" >&2; exit 1; fi
    echo sha256:feed ;;
  create) echo c0ffee ;;
  export) tar -c -C "$FAKE_ROOTFS" etc dev ;;
esac
"""
FAKE_CTR = """#!/bin/bash
echo "ctr $*" >> "$FAKE_LOG"
cat > "$FAKE_CTR_INPUT"
"""


def test_build_runs_each_step_and_says_in_one_line_what_failed(tmp_path, monkeypatch):
    # The commands run against stand-ins for docker and ctr (the real tar extracts).
    bin_dir, rootfs_src, out = tmp_path / "bin", tmp_path / "image-fs", tmp_path / "rootfs"
    bin_dir.mkdir()
    for name, script in (("docker", FAKE_DOCKER), ("ctr", FAKE_CTR)):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    (rootfs_src / "etc").mkdir(parents=True)
    (rootfs_src / "etc" / "os-release").write_text("ID=fake\n")
    (rootfs_src / "dev").mkdir()
    (rootfs_src / "dev" / "console").write_text("")
    socket = tmp_path / "containerd.sock"
    socket.write_text("")
    log = tmp_path / "log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_ROOTFS", str(rootfs_src))
    monkeypatch.setenv("FAKE_CTR_INPUT", str(tmp_path / "ctr-input"))
    tasks_dir = tmp_path / "tasks"
    shutil.copytree(FIXTURES / "image-task", tasks_dir / "image-task")
    make_task(tasks_dir, "no-base", environment={"Dockerfile": "FROM nosuch:1\n"})
    args = ["tasks", "build", str(tasks_dir), "--node-import", "--containerd-socket", str(socket)]
    args += ["--push", "reg:5000/team", "--rootfs", str(out)]

    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    built = {task_id: image for image, task_id, _ in harbor_images(tasks_dir)}
    tag = built["image-task"].split(":")[-1]
    assert said(result) == [
        f"image-task: built {built['image-task']}",
        f"image-task: imported {built['image-task']} into the node's containerd",
        f"image-task: pushed reg:5000/team/harbor-image-task:{tag}",
        f"image-task: rootfs {out}/rollout.local_harbor-image-task_{tag}",
        f"error: no-base: docker build of {built['no-base']}: cannot get its base image "
        "nosuch:1 (not in the local Docker, and pulling it failed): docker build failed: "
        "ERROR: failed to solve: nosuch:1: pull access denied, repository does not exist",
        "  provide nosuch:1: `docker tag <an image you have> nosuch:1`, or `docker load -i` a "
        'saved copy, or set a mirror of Docker Hub ("registry-mirrors" in '
        "/etc/docker/daemon.json, then restart dockerd)",
    ]
    assert (tmp_path / "ctr-input").read_text() == "an image archive"
    extracted = out / f"rollout.local_harbor-image-task_{tag}"
    assert (extracted / "etc" / "os-release").read_text() == "ID=fake\n"
    assert list((extracted / "dev").iterdir()) == []  # /dev is the sandbox's own
    assert (out / f"rollout.local_harbor-image-task_{tag}.image-id").read_text() == "sha256:feed\n"
    assert "docker rm -f c0ffee" in log.read_text()

    # Once extracted for this image id, the rootfs is not exported again.
    log.write_text("")
    result = CliRunner().invoke(cli, [*args[:3], "--task", "image-task", "--rootfs", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1].endswith("(already there)")
    assert "docker export" not in log.read_text()


# -- hostile task folders (issue 43): links and special files are never read ------------------

SECRET = "root:x:0:0:host secret\n"


def host_files(tmp_path: Path) -> Path:
    """Files outside every task folder, standing in for /etc/passwd or ~/.ssh."""
    host = tmp_path / "host"
    (host / "dir").mkdir(parents=True)
    (host / "passwd").write_text(SECRET)
    (host / "dir" / "test.sh").write_text(SECRET)
    (host / "dir" / "id_rsa").write_text(SECRET)
    return host


@pytest.mark.parametrize(
    ("entry", "target"),
    [
        ("instruction.md", "passwd"),
        ("task.toml", "toml"),  # a valid TOML: only the link itself can be refused
        ("tests", "dir"),
        ("solution", "dir"),
        ("environment", "dir"),
        ("environment/Dockerfile", "passwd"),
    ],
)
def test_a_link_at_the_top_of_a_task_folder_is_refused_naming_task_and_path(
    tmp_path, entry, target
):
    host = host_files(tmp_path)
    (host / "toml").write_text('version = "1.0"\n')
    tasks = tmp_path / "tasks"
    folder = make_task(tasks, "t", solution={"solve.sh": "true\n"})
    link = folder / entry
    if link.is_dir():
        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    os.symlink(host / target, link)
    text = refusal(tasks)
    assert f"task 't': {entry} is a symbolic link" in text
    assert "host secret" not in text
    # `rollout tasks show` reads the folder the same way.
    result = CliRunner().invoke(cli, ["tasks", "show", str(tasks)])
    assert result.exit_code != 0 and f"{entry} is a symbolic link" in result.output
    assert "host secret" not in result.output


def test_a_task_folder_linked_into_a_folder_of_tasks_is_refused(tmp_path):
    tasks = tmp_path / "tasks"
    make_task(tasks, "fine")
    os.symlink(make_task(tmp_path / "elsewhere", "outside"), tasks / "outside")
    assert "task 'outside': the task folder is a symbolic link" in refusal(tasks)
    assert [t["id"] for t in load_harbor_tasks(tasks, ["fine"])] == ["fine"]


def test_a_link_inside_a_build_context_is_refused_and_never_hashed_through(tmp_path):
    host = host_files(tmp_path)
    folder = make_task(tmp_path / "tasks", "t", environment={"Dockerfile": "FROM x\nCOPY . /\n"})
    os.symlink(host / "dir", folder / "environment" / "keys")
    assert "task 't': environment/keys is a symbolic link" in refusal(tmp_path / "tasks")


@pytest.mark.timeout(20)  # before the fix, reading a FIFO blocked for good
@pytest.mark.parametrize(
    ("fifo", "dockerfile"),
    [
        ("instruction.md", False),
        ("task.toml", False),
        ("tests/test.sh", False),
        ("tests/helper.py", False),
        ("solution/solve.sh", False),
        ("environment/data.txt", False),
        ("environment/data.txt", True),  # a build context: hashed for the image tag
    ],
)
def test_a_fifo_in_a_task_folder_is_refused_without_blocking(tmp_path, fifo, dockerfile):
    environment = {"Dockerfile": "FROM x\n"} if dockerfile else None
    folder = make_task(tmp_path, "t", environment=environment, solution={"solve.sh": "true\n"})
    (folder / fifo).unlink(missing_ok=True)
    os.mkfifo(folder / fifo)
    assert f"task 't': {fifo} is not a plain file" in refusal(tmp_path)

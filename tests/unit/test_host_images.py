"""Task images on sandbox hosts (issue 46): what a host tells of the images it carries (its
--rootfs, with each mounted image's WORKDIR written beside it), and the submit-time refusal of a
batch whose image some live host does not carry (any host takes any episode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from rollout_wire.request import parse_spec
from rollout_worker.backends.host import agent, images
from rollout_worker.backends.host.backend import _task_problems, image_problems
from rollout_worker.backends.host.run import Machine
from rollout_worker.backends.local.sandbox import ImageRoot

IMAGE = "rollout.local/harbor-image-task:1"
FOLDER = "rollout.local_harbor-image-task_1"
IMAGE_TASK = {
    "id": "in-its-image",
    "statement": "Fix /app/greet.py.",
    "image": IMAGE,
    "files": {},  # as a Harbor task whose environment is its Dockerfile: the image holds all
    "tests": {"test.sh": "exit 0\n"},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
}
FILE_TASK = {
    "id": "files",
    "statement": "Fix a.py.",
    "image": "rollout.local/other:1",  # with files: the files are the workspace, no image root
    "files": {"a.py": "x = 1\n"},
    "test_command": ["python", "-c", "pass"],
    "reward": "all",
}


def host_spec(*tasks: dict):
    request = {
        "backend": "kubernetes",
        "isolation": "host",
        "tasks": list(tasks),
        "policy": {"url": "http://10.0.0.1:8000/v1"},
    }
    return parse_spec(request, max_episodes=None)


def test_an_image_task_is_no_longer_refused_as_such():
    # Before: "sandbox hosts run file tasks only (no host carries task images yet)".
    assert _task_problems(host_spec(IMAGE_TASK)) == []


def test_a_batch_runs_only_where_every_live_host_carries_its_images():
    spec = host_spec(IMAGE_TASK, FILE_TASK)
    carrier = {"images": [FOLDER, "other_2"]}
    assert image_problems(spec, {"h0": carrier, "h1": carrier}) == []
    # A file task's image is not needed: its files are its workspace on the host's own root.
    assert image_problems(host_spec(FILE_TASK), {"h0": {"images": []}}) == []
    # One host without it: any host may take any episode, so the batch is refused, naming the
    # image, the host that lacks it and what that host carries.
    (problem,) = image_problems(spec, {"h0": carrier, "h1": {"images": ["other_2"]}})
    assert problem.startswith(
        f"task image {IMAGE} (folder {FOLDER}): sandbox hosts ['h1'] do not carry it "
        "(their images: {'h1': ['other_2']})"
    )
    assert "hosts.images" in problem and "isolation: pod" in problem
    # None has it (a heartbeat without `images`: an agent that tells none carries none).
    (problem,) = image_problems(spec, {"h0": {"images": []}, "h1": {}})
    assert "no live sandbox host carries it (their images: {'h0': [], 'h1': []})" in problem


def test_a_host_tells_the_images_mounted_under_its_rootfs_with_their_workdirs(tmp_path: Path):
    rootfs = tmp_path / "images"
    (rootfs / FOLDER / "usr").mkdir(parents=True)  # what an image volume shows: its files
    (rootfs / "other-image").mkdir()
    args = agent.parse(
        [
            *("--redis-url", "redis://x", "--rootfs", str(rootfs)),
            *("--image-workdir", f"{IMAGE}=/app", "--image-workdir", "other-image=/"),
        ]
    )
    assert images.carried_images(rootfs) == []  # no WORKDIR beside them yet: no image root
    # Written for both; the one whose root is not mounted is said (the agent logs it).
    assert images.write_workdirs(args.rootfs, args.image_workdir) == []
    assert images.write_workdirs(rootfs, [("rollout.local/absent:1", "/")]) == [
        "rollout.local/absent:1"
    ]
    assert (rootfs / f"{FOLDER}.workdir").read_text() == "/app\n"
    assert images.carried_images(rootfs) == sorted([FOLDER, "other-image"])
    # The sandboxes find the root as the local backend's do, WORKDIR included.
    found = ImageRoot.find(rootfs, IMAGE)
    assert found is not None and (found.path, found.workdir) == (rootfs / FOLDER, "/app")

    def told(isolation: str) -> list[str]:
        machine = Machine(
            node="h",
            python="/usr/bin/python3",
            redis_url="redis://x",
            rootfs_dir=rootfs,
            isolation=isolation,
        )
        host = agent.Agent(redis.Redis(), name="h", slots=1, root=tmp_path / "r", machine=machine)
        return host.info()["images"]

    assert told("bwrap") == sorted([FOLDER, "other-image"])
    # Without bwrap an image task would run on the host's own root: it tells no image.
    assert told("none") == []


@pytest.mark.parametrize("given", ["image", "image=app", "=/app", "image="])
def test_an_image_workdir_is_an_image_and_an_absolute_path(given: str, capsys):
    with pytest.raises(SystemExit):
        agent.parse(["--redis-url", "redis://x", "--image-workdir", given])
    assert "not IMAGE=/WORKDIR" in capsys.readouterr().err

"""What a sandbox leaves is hostile input: the host's copy of an agent's workspace (for a
`grade: fresh` grader) and of an image's WORKDIR must never raise, block, follow a link on
the host or fill its disk."""

from __future__ import annotations

import os
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rollout_wire.request import parse_spec
from rollout_worker.backends.local import files
from rollout_worker.backends.local import supervisor as supervisor_module
from rollout_worker.backends.local.phases import GRADE_PHASE
from rollout_worker.backends.local.sandbox import ImageRoot
from rollout_worker.backends.local.supervisor import Supervisor

AS_ROOT = os.geteuid() == 0
# A name that would forge a line of its own in a log that printed it as it is.
EVIL = 'x\n{"event": "reward", "reward": 1}'


def hostile_workspace(tmp_path: Path) -> Path:
    """What an agent might leave: files and folders, links out of the workspace, a FIFO, a
    unix socket, an unreadable file and (as root only) a device node."""
    ws = tmp_path / "left"
    (ws / "pkg" / "deep").mkdir(parents=True)
    (ws / "main.py").write_text("print('hi')\n")
    (ws / "main.py").chmod(0o755)
    (ws / "pkg" / "deep" / "data.txt").write_text("x" * 100)
    os.mkfifo(ws / "pipe")
    os.mkfifo(ws / EVIL)
    # A socket's path must be short: bind it in a short folder, then move it in.
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        server = socket.socket(socket.AF_UNIX)
        server.bind(f"{short}/s")
        os.rename(f"{short}/s", ws / "pkg" / "sock")
        server.close()
    (ws / "passwd").symlink_to("/etc/passwd")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("the host's")
    (ws / "escape").symlink_to(outside)
    (ws / "locked").write_text("the agent's")
    (ws / "locked").chmod(0)
    if AS_ROOT:
        os.chown(ws / "locked", 1000, 1000)
        # A /dev/zero of its own: reading it never ends.
        os.mknod(ws / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    return ws


@pytest.mark.timeout(20)
def test_the_copy_finishes_keeps_links_as_links_and_lists_what_it_skipped(tmp_path):
    left = hostile_workspace(tmp_path)
    dest = tmp_path / "ws"
    copied = files.copy_tree(left, dest)
    assert copied.cut is None
    assert (dest / "main.py").read_text() == "print('hi')\n"
    assert stat.S_IMODE((dest / "main.py").stat().st_mode) == 0o755
    assert (dest / "pkg" / "deep" / "data.txt").read_text() == "x" * 100
    # Links are copied as links, never followed on the host.
    assert (dest / "passwd").is_symlink() and os.readlink(dest / "passwd") == "/etc/passwd"
    assert (dest / "escape").is_symlink() and os.readlink(dest / "escape") == str(
        tmp_path / "outside"
    )
    # Specials are skipped and listed (the grader's sandbox does not see them).
    skipped = dict(copied.skipped)
    assert skipped["pipe"] == "fifo" and skipped["pkg/sock"] == "socket"
    assert skipped[EVIL] == "fifo"
    for name in ("pipe", "pkg/sock", "zero", EVIL):
        assert not os.path.lexists(dest / name)
    if AS_ROOT:
        assert skipped["zero"] == "device"
        assert (dest / "locked").read_text() == "the agent's"
        assert stat.S_IMODE((dest / "locked").stat().st_mode) == 0
    else:
        assert "locked" in skipped or (dest / "locked").exists()
    assert set(skipped) <= {"pipe", "pkg/sock", "zero", "locked", EVIL}
    # The caller logs what was skipped: one line, its names escaped.
    note = copied.summary()
    assert note is not None and "\n" not in note and "fifo 'pipe'" in note


def test_a_copy_past_its_bounds_stops_with_a_marker_and_keeps_what_it_copied(tmp_path):
    left = tmp_path / "left"
    left.mkdir()
    for number in range(10):
        (left / f"f{number}").write_bytes(b"y" * 100)
    by_entries = files.copy_tree(left, tmp_path / "a", max_entries=4)
    assert by_entries.cut is not None and "4 entries" in by_entries.cut
    assert len(os.listdir(tmp_path / "a")) == 4
    by_bytes = files.copy_tree(left, tmp_path / "b", max_bytes=250)
    assert by_bytes.cut is not None and "250 bytes" in by_bytes.cut
    assert len(os.listdir(tmp_path / "b")) == 2
    # Nesting deeper than the copy goes is skipped and listed, not followed.
    deep = tmp_path / "deep"
    (deep / "a" / "b" / "c").mkdir(parents=True)
    (deep / "a" / "b" / "c" / "f").write_text("z")
    shallow = files.copy_tree(deep, tmp_path / "c", max_depth=2)
    assert dict(shallow.skipped) == {"a/b/c": "too deep"}
    assert (tmp_path / "c" / "a" / "b").is_dir()


def test_a_workspace_that_is_no_folder_copies_as_an_empty_one(tmp_path):
    (tmp_path / "link").symlink_to("/etc")
    copied = files.copy_tree(tmp_path / "link", tmp_path / "ws")
    assert (tmp_path / "ws").is_dir() and not os.listdir(tmp_path / "ws")
    assert dict(copied.skipped) == {".": "not a directory"}


def test_an_image_workdir_resolves_inside_its_root_never_on_the_host(tmp_path):
    root = tmp_path / "rootfs"
    for folder in ("etc", "srv/app", "usr"):
        (root / folder).mkdir(parents=True)
    (root / "app").symlink_to("/etc")  # absolute: the image's /etc, not the host's
    (root / "code").symlink_to("srv/app")
    (root / "up").symlink_to("../../../..")  # `..` stops at the image's /
    (root / "loop1").symlink_to("loop2")
    (root / "loop2").symlink_to("loop1")
    (root / "usr" / "file").write_text("x")
    assert files.resolve_in_root(root, "/app") == "/etc"
    assert files.resolve_in_root(root, "/code") == "/srv/app"
    assert files.resolve_in_root(root, "/up/srv/./app/../app") == "/srv/app"
    assert files.resolve_in_root(root, "/up") == "/"
    for bad in ("/loop1", "/usr/file", "/missing"):
        with pytest.raises(ValueError, match="WORKDIR"):
            files.resolve_in_root(root, bad)


# -- the supervisor's call sites: its sandbox is never started here (Popen stops the test) --
class Started(Exception):
    pass


def supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    task = {
        "id": "t",
        "statement": "Fix calc.py.",
        "files": {"calc.py": "x = 1\n"},
        "tests": {"test.sh": "exit 0\n"},
        "test_command": ["bash", "/tests/test.sh"],
        "agent": "oracle",  # no policy to ask
        "solution": {"solve.sh": "true\n"},
        "grade": "fresh",
    }
    spec = parse_spec({"backend": "local", "tasks": [task], "samples_per_task": 2}, max_episodes=10)
    run = {
        "spec": spec.to_dict(),
        "created_at": time.time(),
        "limits": {"memory_bytes": 2**30, "cpu_seconds": 60},
        "isolation": "none",
        "python": sys.executable,
        "python_prefix": sys.prefix,
        "episode_prefix": "rollout-test",
        "node": "here",
        "image_id": "local://test",
    }
    files.write_json_atomic(tmp_path / "run" / "run.json", run)

    def popen(*_: object, **__: object) -> None:
        raise Started

    monkeypatch.setattr(supervisor_module.subprocess, "Popen", popen)
    return Supervisor(files.RunDir(tmp_path / "run"))


@pytest.mark.timeout(20)
def test_a_fresh_grader_starts_on_a_copy_of_a_hostile_workspace(tmp_path, monkeypatch, capsys):
    run = supervisor(tmp_path, monkeypatch)
    left = hostile_workspace(tmp_path)
    workspace = run.dir.workspace(0)
    workspace.parent.mkdir(parents=True)
    left.rename(workspace)
    with pytest.raises(Started):  # the copy did not raise: the grader's sandbox starts
        run.start(0, GRADE_PHASE, since=time.time())
    assert (workspace / "main.py").exists() and not os.path.lexists(workspace / "pipe")
    assert "fifo 'pipe'" in capsys.readouterr().out


def test_an_image_workdir_is_copied_from_the_image_never_from_the_host(tmp_path, monkeypatch):
    run = supervisor(tmp_path, monkeypatch)
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "image-file").write_text("the image's")
    (rootfs / "app").symlink_to("/etc")  # the image's /etc; on the host, the host's
    monkeypatch.setattr(run, "image_root", lambda _: ImageRoot(rootfs, "/app"))
    with pytest.raises(Started):
        run.start(0)
    assert os.listdir(run.dir.workspace(0)) == ["image-file"]
    # A WORKDIR that is no folder in the image: the episode fails to start, nothing else.
    (rootfs / "etc" / "image-file").unlink()
    (rootfs / "etc").rmdir()
    run.start(1)
    status = run.dir.read_json(run.dir.status(1))
    assert status is not None and (status["phase"], status["reason"]) == ("Failed", "StartError")

"""Whole bwrap argument lists of a local sandbox, pinned argument by argument: the order of
mounts matters to bwrap (a later mount hides an earlier one), and the environment's order is
what `--setenv` writes. The host's own system mounts (merged /usr or not) are spliced in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout_worker.backends.local import sandbox
from rollout_worker.backends.local.sandbox import ImageRoot, Mount, plan_sandbox
from rollout_worker.sandbox import compiled_path

NAMESPACES = ["--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session"]
IDENTITY = ["--cap-drop", "ALL", "--uid", "1000", "--gid", "1000"]
DEV = ["--proc", "/proc", "--dev", "/dev", "--size", "67108864", "--tmpfs", "/dev/shm"]
BASE_ENV = [
    *("--setenv", "EPISODE_ID", "e-1"),
    *("--setenv", "ROLLOUT_ACTION", "fix"),
]
REST_ENV = [
    *("--setenv", "PYTHONDONTWRITEBYTECODE", "1"),
    *("--setenv", "LANG", "C.UTF-8"),
]
DEFAULT_PATH = ["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    program = tmp_path / "episode.py"
    program.write_text("pass\n")
    compiled_program = tmp_path / "c" / "episode.py"
    compiled_program.parent.mkdir()
    compiled_program.write_text("pass\n")
    compiled = compiled_path(compiled_program)
    compiled.parent.mkdir(parents=True, exist_ok=True)
    compiled.write_bytes(b"")
    later = compiled_program.stat().st_mtime_ns + 10**9
    os.utime(compiled, ns=(later, later))
    (tmp_path / "root/usr/local/bin").mkdir(parents=True)
    (tmp_path / "root/usr/local/bin/python3").write_text("")
    return {"program": program, "compiled_program": compiled_program}


def plan(tmp_path: Path, **changes: object) -> sandbox.SandboxPlan:
    options: dict = {
        "isolation": "bwrap",
        "python": "/usr/bin/python3",
        "python_prefix": "/usr",
        "program": tmp_path / "episode.py",
        "workspace": tmp_path / "ws",
        "episode_id": "e-1",
        "action": "fix",
        "running_as_root": False,
    } | changes
    return plan_sandbox(**options)


def mounts(tmp_path: Path) -> list[Mount]:
    return [
        Mount(tmp_path / "tasks.json", "/sandbox/tasks.json", "ROLLOUT_TASKS_FILE"),
        Mount(tmp_path / "logs", "/logs", "", writable=True),
    ]


def test_a_plain_bwrap_sandbox(tmp_path, files):
    T = str(tmp_path)
    made = plan(tmp_path)
    assert made.argv == [
        "bwrap",
        *NAMESPACES,
        *IDENTITY,
        *sandbox._system_mounts(),
        # An interpreter prefix of exactly /usr is bound again (harmless: the same folder).
        *("--ro-bind", "/usr", "/usr"),
        *DEV,
        *("--size", "268435456", "--tmpfs", "/tmp"),
        *("--ro-bind", f"{T}/episode.py", "/sandbox/episode.py"),
        *("--bind", f"{T}/ws", "/workspace"),
        *("--chdir", "/workspace", "--clearenv"),
        *BASE_ENV,
        *DEFAULT_PATH,
        *REST_ENV,
        *("--setenv", "ROLLOUT_WORKSPACE", "/workspace"),
        *("--setenv", "HOME", "/workspace"),
        *("--setenv", "ROLLOUT_COST_SOURCE", "proc"),
        *("--", "/usr/bin/python3", "-B", "/sandbox/episode.py"),
    ]
    assert (made.env, made.cwd, made.run_as) == ({}, f"{T}/ws", None)


def test_a_bwrap_sandbox_with_every_option(tmp_path, files):
    T = str(tmp_path)
    made = plan(
        tmp_path,
        status_fd=7,
        tmp=tmp_path / "tmp",
        mounts=mounts(tmp_path),
        extra_env={"ROLLOUT_ATTEMPT": "1", "PATH": "/x"},
        python_prefix="/opt/py",
        workdir="/app",
        program=files["compiled_program"],
        running_as_root=True,
    )
    assert made.argv == [
        *("bwrap", "--json-status-fd", "7"),
        *NAMESPACES,
        *IDENTITY,
        *sandbox._system_mounts(),
        *("--ro-bind", "/opt/py", "/opt/py"),
        *DEV,
        *("--bind", f"{T}/tmp", "/tmp"),
        *("--ro-bind", f"{T}/c/episode.py", "/sandbox/episode.py"),
        *("--ro-bind", f"{T}/c/episode.pyc", "/sandbox/episode.pyc"),
        *("--bind", f"{T}/ws", "/app"),
        *("--ro-bind", f"{T}/tasks.json", "/sandbox/tasks.json"),
        *("--bind", f"{T}/logs", "/logs"),
        *("--chdir", "/app", "--clearenv"),
        *BASE_ENV,
        *("--setenv", "PATH", "/x"),
        *REST_ENV,
        *("--setenv", "ROLLOUT_ATTEMPT", "1"),
        *("--setenv", "ROLLOUT_WORKSPACE", "/app"),
        *("--setenv", "HOME", "/app"),
        *("--setenv", "ROLLOUT_COST_SOURCE", "proc"),
        *("--setenv", "ROLLOUT_TASKS_FILE", "/sandbox/tasks.json"),
        *("--", "/usr/bin/python3", "-B", "/sandbox/episode.pyc"),
    ]
    assert (made.env, made.cwd, made.run_as) == ({}, f"{T}/ws", (1000, 1000))


def test_a_bwrap_sandbox_in_a_task_image(tmp_path, files):
    T = str(tmp_path)
    made = plan(
        tmp_path,
        root=ImageRoot(tmp_path / "root", "/src"),
        mounts=mounts(tmp_path),
        program=files["compiled_program"],  # an image's interpreter runs the source
    )
    assert made.argv == [
        "bwrap",
        *NAMESPACES,
        *IDENTITY,
        *("--ro-bind", f"{T}/root", "/"),
        *("--size", "1048576", "--tmpfs", "/sandbox"),
        *DEV,
        *("--size", "268435456", "--tmpfs", "/tmp"),
        *("--ro-bind", f"{T}/c/episode.py", "/sandbox/episode.py"),
        *("--bind", f"{T}/ws", "/src"),
        *("--ro-bind", f"{T}/tasks.json", "/sandbox/tasks.json"),
        *("--bind", f"{T}/logs", "/logs"),
        *("--chdir", "/src", "--clearenv"),
        *BASE_ENV,
        *DEFAULT_PATH,
        *REST_ENV,
        *("--setenv", "ROLLOUT_WORKSPACE", "/src"),
        *("--setenv", "HOME", "/src"),
        *("--setenv", "ROLLOUT_COST_SOURCE", "proc"),
        *("--setenv", "ROLLOUT_TASKS_FILE", "/sandbox/tasks.json"),
        *("--", "/usr/local/bin/python3", "-B", "/sandbox/episode.py"),
    ]
    assert (made.env, made.cwd, made.run_as) == ({}, f"{T}/ws", None)


def test_an_unsandboxed_process(tmp_path, files):
    T = str(tmp_path)
    made = plan(
        tmp_path,
        isolation="none",
        mounts=mounts(tmp_path),
        program=files["compiled_program"],
        running_as_root=True,
        extra_env={"A": "b"},
    )
    assert made.argv == ["/usr/bin/python3", "-B", f"{T}/c/episode.pyc"]
    assert list(made.env.items()) == [
        ("EPISODE_ID", "e-1"),
        ("ROLLOUT_ACTION", "fix"),
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("LANG", "C.UTF-8"),
        ("A", "b"),
        ("ROLLOUT_WORKSPACE", f"{T}/ws"),
        ("HOME", f"{T}/ws"),
        ("ROLLOUT_TASKS_FILE", f"{T}/tasks.json"),
    ]
    assert (made.cwd, made.run_as) == (f"{T}/ws", (1000, 1000))


def test_a_sandbox_hosts_bwrap_forbids_user_namespaces_inside(tmp_path, files):
    # In a sandbox host (a Pod in a user namespace of its own) an episode must not make user
    # namespaces: bwrap needs a user namespace of its own for that (--unshare-user).
    made = plan(tmp_path, disable_userns=True).argv
    start = made.index("--unshare-all")
    assert made[start : start + 3] == ["--unshare-all", "--unshare-user", "--disable-userns"]
    assert made[: start + 1] + made[start + 3 :] == plan(tmp_path).argv


def test_an_image_root_without_mount_points_is_shown_entry_by_entry_then_made_read_only(
    tmp_path, files
):
    # A Kubernetes image volume holds the image as built: no /sandbox, /workspace, /logs...
    # bwrap cannot make those inside a read-only bind of it ("Can't mkdir /sandbox: Read-only
    # file system"), so each entry is shown at its place on bwrap's own root, which is then
    # remounted read-only once every mount point is made.
    T = str(tmp_path)
    image = tmp_path / "root"
    (image / "app").mkdir()
    (image / "bin").symlink_to("usr/bin")
    (image / ".dockerenv").write_text("")
    (image / "proc").mkdir()  # mounted over anyway: not shown
    os.mkfifo(image / "fifo")  # neither file nor folder: left out
    made = plan(
        tmp_path,
        root=ImageRoot(image, "/app", mount_points=False),
        mounts=mounts(tmp_path),
        program=files["compiled_program"],
    )
    assert made.argv == [
        "bwrap",
        *NAMESPACES,
        *IDENTITY,
        *("--ro-bind", f"{T}/root/.dockerenv", "/.dockerenv"),
        *("--ro-bind", f"{T}/root/app", "/app"),
        *("--symlink", "usr/bin", "/bin"),
        *("--ro-bind", f"{T}/root/usr", "/usr"),
        *("--size", "1048576", "--tmpfs", "/sandbox"),
        *DEV,
        *("--size", "268435456", "--tmpfs", "/tmp"),
        *("--ro-bind", f"{T}/c/episode.py", "/sandbox/episode.py"),
        *("--bind", f"{T}/ws", "/app"),
        *("--ro-bind", f"{T}/tasks.json", "/sandbox/tasks.json"),
        *("--bind", f"{T}/logs", "/logs"),
        *("--remount-ro", "/"),
        *("--chdir", "/app", "--clearenv"),
        *BASE_ENV,
        *DEFAULT_PATH,
        *REST_ENV,
        *("--setenv", "ROLLOUT_WORKSPACE", "/app"),
        *("--setenv", "HOME", "/app"),
        *("--setenv", "ROLLOUT_COST_SOURCE", "proc"),
        *("--setenv", "ROLLOUT_TASKS_FILE", "/sandbox/tasks.json"),
        *("--", "/usr/local/bin/python3", "-B", "/sandbox/episode.py"),
    ]


def test_an_image_root_is_found_with_or_without_the_exports_mount_points(tmp_path):
    rootfs = tmp_path / "rootfs"
    image = rootfs / sandbox.rootfs_dirname("team/env:1")
    (image / "usr").mkdir(parents=True)
    assert ImageRoot.find(rootfs, "team/env:1") is None  # no WORKDIR beside it: not a root
    (rootfs / "team_env_1.workdir").write_text("/app\n")
    # As an image volume shows it: the image's own files only.
    assert ImageRoot.find(rootfs, "team/env:1") == ImageRoot(image, "/app", mount_points=False)
    for point in sandbox.MOUNT_POINTS[:-1]:
        (image / point).mkdir()
    (image / "dev").symlink_to("tmp")  # a link is no mount point bwrap can use
    assert ImageRoot.find(rootfs, "team/env:1") == ImageRoot(image, "/app", mount_points=False)
    (image / "dev").unlink()
    (image / "dev").mkdir()
    # As `rollout tasks build --rootfs` exports it: every mount point made.
    assert ImageRoot.find(rootfs, "team/env:1") == ImageRoot(image, "/app", mount_points=True)

"""One local sandbox: its bwrap command line and its resource limits. Pure: no I/O beyond what
the caller passes in."""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_worker.sandbox import HARNESS_COMPILED, PROGRAM_MOUNT, compiled_path

SANDBOX_UID = 1000
SANDBOX_GID = 1000
WORKSPACE_MOUNT = "/workspace"
COMPILED_MOUNT = "/sandbox/episode.pyc"
# The test harness's bytecode, beside the program's (the runner looks there).
HARNESS_MOUNT = "/sandbox/" + HARNESS_COMPILED
# rlimits every sandbox gets besides its memory and CPU (from the batch's resources). One file
# may hold the episode's whole disk limit and a little more (so writing past the limit is
# measured as over it: local/disk.py), FILE_SIZE_LIMIT when no limit is given.
FILE_SIZE_LIMIT = 64 * 2**20
FILE_SIZE_MARGIN = 2**20
OPEN_FILES_LIMIT = 256
# RLIMIT_NPROC counts every process and thread of the real uid, and every local sandbox is
# host uid 1000: this is a cap on all sandboxes of the machine together (plus that uid's
# other processes: the worker's own when it does not run as root), not one sandbox's share.
# 4096 leaves 64 for each of 64 busy sandboxes (a build, a test runner's threads) and stops a
# fork bomb there, not at the host's pid_max. A bomb can still starve the other sandboxes
# (their forks then fail until it is killed at its deadline); a per-sandbox cgroup pids.max
# would not, but needs a cgroup the worker may write: a root worker can (the pids
# controller), an unprivileged one only with a delegated subtree.
PROCESS_LIMIT = 4096
# tmpfs is RAM that no address-space limit counts: each one a sandbox can write is sized.
TMP_SIZE_LIMIT = 256 * 2**20  # /tmp, unless a host folder is mounted there
SHM_SIZE_LIMIT = 64 * 2**20  # /dev/shm (Docker's default)
SANDBOX_DIR_SIZE_LIMIT = 2**20  # /sandbox over an image's root: mount points only


@dataclass(frozen=True)
class Mount:
    """A host file or folder shown inside the sandbox at `target` (read-only unless
    `writable`); the environment variable `env` tells the episode where it is (the target in
    bwrap, the host path without it; "" sets none)."""

    host: Path
    target: str
    env: str
    writable: bool = False


# `rollout tasks build --rootfs DIR` leaves, per image: DIR/<name>/ (its files) and
# DIR/<name>.workdir (its WORKDIR), written last.
WORKDIR_SUFFIX = ".workdir"
# Where a sandbox mounts things over an image's read-only root: they must exist in it (bwrap
# cannot create a mount point inside a read-only bind).
MOUNT_POINTS = ("sandbox", "workspace", "tmp", "logs", "tests", "solution", "proc", "dev")


def _real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def rootfs_dirname(image: str) -> str:
    """An image name as one path-safe folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", image)


@dataclass(frozen=True)
class ImageRoot:
    """An image's root filesystem, exported for bubblewrap: the sandbox's / (read-only), with
    a per-episode copy of its working directory writable at `workdir`. `mount_points`: the
    root holds MOUNT_POINTS (the export makes them); a root that does not (a Kubernetes image
    volume on a sandbox host: the image's files as built, read-only) is shown entry by entry
    instead, on a root of bubblewrap's own where the mount points can be made."""

    path: Path
    workdir: str
    mount_points: bool = True

    @classmethod
    def find(cls, rootfs_dir: Path, image: str) -> ImageRoot | None:
        path = rootfs_dir / rootfs_dirname(image)
        workdir = rootfs_dir / (rootfs_dirname(image) + WORKDIR_SUFFIX)
        if not (path.is_dir() and workdir.is_file()):
            return None
        made = all(_real_dir(path / point) for point in MOUNT_POINTS)
        return cls(path, workdir.read_text().strip() or "/", made)

    @property
    def python(self) -> str:
        found = [d for d in ("usr/local/bin", "usr/bin") if (self.path / d / "python3").exists()]
        return f"/{found[0]}/python3" if found else "/usr/bin/python3"


@dataclass(frozen=True)
class SandboxPlan:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    # The host user that starts the sandbox when the supervisor runs as root: bwrap's user
    # namespace then maps the sandbox's uid 1000 to host uid 1000, never to host root.
    run_as: tuple[int, int] | None
    # Variables the runner gets that may hold a resolved ${VAR} of a task (a secret): with
    # bwrap never on its command line (any host user can read that in /proc), but through
    # `--args FD` (`argv_with_secrets`) at `secret_at`; without bwrap in `env` already.
    secret_env: dict[str, str] = field(default_factory=dict)
    secret_at: int = 0

    def argv_with_secrets(self, fd: int) -> list[str]:
        """bwrap's argv reading the secret variables' --setenv from `fd`."""
        if not self.secret_env or self.argv[0] != "bwrap":
            return list(self.argv)
        return [*self.argv[: self.secret_at], "--args", str(fd), *self.argv[self.secret_at :]]


def secret_args(env: Mapping[str, str]) -> bytes:
    """bwrap's `--args` data: NUL-separated --setenv NAME VALUE (no value holds a NUL: the
    environment cannot carry one)."""
    words = [word for name, value in env.items() for word in ("--setenv", name, value)]
    return b"".join(word.encode() + b"\0" for word in words)


def _system_mounts() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib64", "lib32"):
        path = Path("/") / top
        if path.is_symlink():  # merged-/usr systems: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), f"/{top}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{top}"]
    return args


def current_bytecode(program: Path) -> Path | None:
    """The bytecode beside the program when its interpreter compiled it (compile_program) and
    the source was not written since (a program replaced by hand runs as written). Not for a
    task image's own interpreter, whose bytecode format may differ."""
    compiled = compiled_path(program)
    try:
        fresh = compiled.stat().st_mtime_ns >= program.stat().st_mtime_ns
    except OSError:
        return None
    return compiled if fresh else None


def plan_sandbox(
    *,
    isolation: str,
    python: str,
    python_prefix: str,
    program: Path,
    workspace: Path,
    episode_id: str,
    action: str,
    running_as_root: bool,
    extra_env: Mapping[str, str] | None = None,
    mounts: Sequence[Mount] = (),
    status_fd: int | None = None,
    tmp: Path | None = None,
    root: ImageRoot | None = None,
    workdir: str | None = None,
    secret_env: Mapping[str, str] | None = None,
    disable_userns: bool = False,
) -> SandboxPlan:
    """How to start one episode: bwrap (own namespaces, read-only system, private /tmp, no
    network, uid 1000, no capabilities) or, with isolation "none", a plain unprivileged process.
    `status_fd` (bwrap only): bwrap writes the sandbox's exit code there, as JSON, for a
    process that is not its parent (a warm sandbox's supervisor). `tmp`: a host folder as the
    sandbox's /tmp instead of a private tmpfs (an episode graded in a second sandbox that must
    find the first one's /tmp as it was left). `root` (bwrap only): the task's image as the
    sandbox's root, its interpreter running the episode, the workspace at the image's WORKDIR.
    `workdir` (bwrap, no `root`): the task's own path for the workspace instead of /workspace.
    `secret_env`: variables kept off the command line (SandboxPlan.secret_env).
    `disable_userns` (bwrap): the episode cannot make user namespaces of its own (a sandbox
    host's episodes, whose host Pod is itself in a user namespace).
    """
    secrets = dict(secret_env or {})
    base_env = {
        "EPISODE_ID": episode_id,
        "ROLLOUT_ACTION": action,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    } | dict(extra_env or {})
    compiled = None if root is not None else current_bytecode(program)
    run_as = (SANDBOX_UID, SANDBOX_GID) if running_as_root else None
    if isolation == "none":
        env = base_env | {"ROLLOUT_WORKSPACE": str(workspace), "HOME": str(workspace)}
        env |= {m.env: str(m.host) for m in mounts if m.env}
        argv = [python, "-B", str(compiled or program)]
        return SandboxPlan(argv, env | secrets, str(workspace), run_as, secrets)
    if isolation != "bwrap":
        raise ValueError(f"unknown isolation {isolation!r}")
    if workdir and root is not None:
        raise ValueError("workdir with an image root: give it as the root's workdir")
    if root is None:
        # bwrap's own root is a fresh tmpfs: any path can be made the workspace's mount point.
        workspace_mount = workdir or WORKSPACE_MOUNT
        root_args = _host_root(python_prefix)
    else:
        workspace_mount = root.workdir if root.workdir != "/" else WORKSPACE_MOUNT
        root_args = _image_root(root)
        python = root.python
    env = base_env | {"ROLLOUT_WORKSPACE": workspace_mount, "HOME": workspace_mount}
    # --unshare-all gives the sandbox its own PID namespace (and /proc): every process the
    # runner sees there is the episode's, so its cost ledger sums them all.
    env["ROLLOUT_COST_SOURCE"] = "proc"
    env |= {m.env: m.target for m in mounts if m.env}
    argv = [
        "bwrap",
        *_namespaces(status_fd, disable_userns),
        *root_args,
        *_scratch(tmp),
        *_episode_mounts(program, compiled, workspace, workspace_mount, mounts),
        # An image shown entry by entry: its / (bubblewrap's own) read-only once every mount
        # point is made, as the exported root's is.
        *(["--remount-ro", "/"] if root is not None and not root.mount_points else []),
        "--chdir",
        workspace_mount,
        "--clearenv",
        *(arg for key, value in env.items() for arg in ("--setenv", key, value)),
        *("--", python, "-B", COMPILED_MOUNT if compiled else PROGRAM_MOUNT),
    ]
    # Before "--" and after --clearenv and the --setenv above (bwrap applies them in order).
    return SandboxPlan(argv, {}, str(workspace), run_as, secrets, len(argv) - 4)


def _namespaces(status_fd: int | None, disable_userns: bool = False) -> list[str]:
    """Its own namespaces, session and identity: uid 1000 without capabilities."""
    return [
        *(["--json-status-fd", str(status_fd)] if status_fd is not None else []),
        "--unshare-all",
        # --disable-userns needs a user namespace of bwrap's own, not only one if it can.
        *(["--unshare-user", "--disable-userns"] if disable_userns else []),
        # The runner is the sandbox's PID 1, as in a Pod's container: the kernel then drops
        # the signals its agent sends it (it cannot kill the runner to turn its episode into
        # an infrastructure failure), and no other process holds the runner's stdout for the
        # agent to write events of its own to (the runner is not dumpable: its fds are closed
        # to the agent through /proc).
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
    ]


def _host_root(python_prefix: str) -> list[str]:
    """The host's system, read-only, and the interpreter's prefix when it lives elsewhere."""
    args = _system_mounts()
    if not python_prefix.startswith("/usr/"):
        args += ["--ro-bind", python_prefix, python_prefix]
    return args


def _image_root(root: ImageRoot) -> list[str]:
    """A task image's root, read-only. /sandbox as a tmpfs: the program and task files are
    mounted on it (a file mount point cannot be made inside the read-only root)."""
    sandbox_dir = ["--size", str(SANDBOX_DIR_SIZE_LIMIT), "--tmpfs", "/sandbox"]
    if root.mount_points:
        return ["--ro-bind", str(root.path), "/", *sandbox_dir]
    return [*_image_entries(root.path), *sandbox_dir]


# What every sandbox mounts over an image's own entries of these names.
_REPLACED = frozenset({"sandbox", "proc", "dev", "tmp"})


def _image_entries(path: Path) -> list[str]:
    """Each top-level entry of an image's root, read-only at the same place of bubblewrap's
    root (its links as links): bwrap cannot make a mount point inside a read-only root that
    lacks it. Other kinds of entries (devices, sockets) are left out."""
    args: list[str] = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        target = f"/{entry.name}"
        if entry.name in _REPLACED:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry.path), target]
        elif entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False):
            args += ["--ro-bind", entry.path, target]
    return args


def _scratch(tmp: Path | None) -> list[str]:
    """/proc, /dev and /tmp, each tmpfs sized. First: a bind below /tmp (an agent env kept
    there) must come after the tmpfs, or the tmpfs hides it."""
    return [
        *("--proc", "/proc"),
        # /dev/shm sized (/dev itself stays writable: the Kubernetes stand-ins bind a file at
        # /dev/termination-log there).
        *("--dev", "/dev"),
        *("--size", str(SHM_SIZE_LIMIT), "--tmpfs", "/dev/shm"),
        *(
            ["--bind", str(tmp), "/tmp"]
            if tmp is not None
            else ["--size", str(TMP_SIZE_LIMIT), "--tmpfs", "/tmp"]
        ),
    ]


def _episode_mounts(
    program: Path,
    compiled: Path | None,
    workspace: Path,
    workspace_mount: str,
    mounts: Sequence[Mount],
) -> list[str]:
    """The runner (and its bytecode, and its harness's), the workspace, then the episode's own
    mounts."""
    harness = program.with_name(HARNESS_COMPILED)
    return [
        *("--ro-bind", str(program), PROGRAM_MOUNT),
        *(["--ro-bind", str(compiled), COMPILED_MOUNT] if compiled else []),
        *(["--ro-bind", str(harness), HARNESS_MOUNT] if compiled and harness.exists() else []),
        *("--bind", str(workspace), workspace_mount),
        *(
            arg
            for m in mounts
            for arg in ("--bind" if m.writable else "--ro-bind", str(m.host), m.target)
        ),
    ]


def rlimits(memory_bytes: int, cpu_seconds: int, storage_bytes: int | None = None) -> Any:
    """The preexec function that applies a sandbox's limits in its process."""
    file_size = FILE_SIZE_LIMIT if storage_bytes is None else storage_bytes + FILE_SIZE_MARGIN

    def apply() -> None:
        # rlimits stand in for cgroup limits: address space for memory, CPU seconds for the
        # CPU share over the episode's lifetime.
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES_LIMIT, OPEN_FILES_LIMIT))
        resource.setrlimit(resource.RLIMIT_NPROC, (PROCESS_LIMIT, PROCESS_LIMIT))

    return apply

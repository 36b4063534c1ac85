"""A local sandbox's bounds: sized tmpfs mounts (RAM) and a process cap (fork bombs)."""

from __future__ import annotations

import resource
from pathlib import Path

from rollout_worker.backends.local import sandbox
from rollout_worker.backends.local.sandbox import ImageRoot
from tests.unit.test_sandbox_argv import plan as sandbox_plan


def plan(tmp_path: Path, **changes: object) -> list[str]:
    return sandbox_plan(tmp_path, **changes).argv


def sized_tmpfs(argv: list[str]) -> dict[str, int]:
    """Each tmpfs mount point -> its --size (absent: unsized)."""
    sizes = {}
    for at, arg in enumerate(argv):
        if arg == "--tmpfs":
            sized = at >= 2 and argv[at - 2] == "--size"
            sizes[argv[at + 1]] = int(argv[at - 1]) if sized else -1
    return sizes


def test_every_tmpfs_of_a_sandbox_is_sized(tmp_path):
    argv = plan(tmp_path)
    sizes = sized_tmpfs(argv)
    assert sizes == {"/tmp": sandbox.TMP_SIZE_LIMIT, "/dev/shm": sandbox.SHM_SIZE_LIMIT}
    # A host folder as /tmp (a grader that finds the agent's): no tmpfs there.
    assert "/tmp" not in sized_tmpfs(plan(tmp_path, tmp=tmp_path / "tmp"))
    # An image as the root: its /sandbox tmpfs is sized too.
    rooted = plan(tmp_path, root=ImageRoot(tmp_path / "rootfs", "/app"))
    assert sized_tmpfs(rooted)["/sandbox"] == sandbox.SANDBOX_DIR_SIZE_LIMIT


def test_rlimits_cap_processes_besides_memory_cpu_and_files(monkeypatch):
    applied: dict[int, tuple[int, int]] = {}
    monkeypatch.setattr(resource, "setrlimit", lambda which, pair: applied.__setitem__(which, pair))
    sandbox.rlimits(2**30, 60)()
    assert applied[resource.RLIMIT_AS] == (2**30, 2**30)
    assert applied[resource.RLIMIT_CPU] == (60, 60)
    assert applied[resource.RLIMIT_FSIZE] == (sandbox.FILE_SIZE_LIMIT,) * 2
    assert applied[resource.RLIMIT_NOFILE] == (sandbox.OPEN_FILES_LIMIT,) * 2
    # A machine-wide cap (every sandbox is host uid 1000): room for a busy batch, not a bomb.
    assert applied[resource.RLIMIT_NPROC] == (sandbox.PROCESS_LIMIT,) * 2
    assert 1024 <= sandbox.PROCESS_LIMIT <= 16384

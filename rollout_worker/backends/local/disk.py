"""A local episode's disk limit (the batch's `resources.storage_limit`), as the kubelet keeps
a Pod's: the supervisor measures what the episode's on-disk folders hold (its workspace, and
its /tmp, /logs, /tests and /solution when they are host folders) about once a second and
ends the episode past the limit (`StorageLimitExceeded`: the episode's own failure, never
retried). Measured as du does: allocated blocks, each file once (hard links), no link
followed. Its /tmp and /dev/shm when they are the sandbox's own tmpfs are memory, sized
apart (local/sandbox.py), as a Pod's memory folders are.

Without privileges there is no quota to stop a write at the limit: between two measurements
an episode can write more (the sandbox's RLIMIT_FSIZE keeps any one file near the limit), and
the kubelet's own check is coarser (every 10 s)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from rollout_worker.observation import STORAGE_LIMIT_REASON

# How often the folders are measured: about this often, and never more than a tenth of the
# time (a walk of a huge tree slows the measurements, not the supervisor).
CHECK_SECONDS = 1.0
WALK_SHARE = 10
# An episode with more entries than this is over any limit (each costs the host an inode).
MAX_ENTRIES = 500_000


def disk_use(folders: Iterable[Path], stop_at: int | None = None) -> tuple[int, int]:
    """(bytes allocated, entries) under `folders`, without following a link; the walk stops
    once the bytes pass `stop_at` or the entries MAX_ENTRIES (what it found is then enough)."""
    used, entries, seen = 0, 0, set()
    stack = [str(folder) for folder in folders]
    while stack:
        try:
            scan = os.scandir(stack.pop())
        except OSError:
            continue  # gone meanwhile, or not a folder
        with scan:
            for entry in scan:
                entries += 1
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (info.st_dev, info.st_ino) not in seen:
                    seen.add((info.st_dev, info.st_ino))
                    used += info.st_blocks * 512
                if stat.S_ISDIR(info.st_mode):
                    stack.append(entry.path)
                if (stop_at is not None and used > stop_at) or entries > MAX_ENTRIES:
                    return used, entries
    return used, entries


def over_limit(folders: Iterable[Path], limit: int) -> str | None:
    """The episode's end reason when its folders hold more than `limit` bytes, else None."""
    used, entries = disk_use(folders, stop_at=limit)
    if entries > MAX_ENTRIES:
        return f"{STORAGE_LIMIT_REASON}: the episode made more than {MAX_ENTRIES} files"
    if used > limit:
        return (
            f"{STORAGE_LIMIT_REASON}: the episode's files took more than {used} bytes on disk, "
            f"over its storage_limit of {limit} bytes"
        )
    return None


class DiskWatch:
    """When to measure next: every CHECK_SECONDS, or WALK_SHARE times the last walk's time."""

    def __init__(self) -> None:
        self.next_at = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def measured(self, started: float) -> None:
        took = time.monotonic() - started
        self.next_at = time.time() + max(CHECK_SECONDS, WALK_SHARE * took)

"""A workspace seeded from the task's image (ROLLOUT_PHASE=seed: Kubernetes, `grade: fresh`
for a task in its own image). An init container of that image copies its workdir into the
Pod's workspace volume, which the agent's container and then a fresh grader's mount at the
workdir: the grader receives the workspace the agent left and nothing else. The copy follows
the local backend's (backends/local/files.py copy_tree): folders and regular files with their
mode bits (no setuid) and times, links as links (never followed), never a FIFO, socket or
device, up to 1 GiB, 100,000 entries and 64 levels."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys

from .errors import EXIT_EPISODE_ERROR
from .events import emit, record_outcome

SEED_MAX_BYTES = 2**30
SEED_MAX_ENTRIES = 100_000
SEED_MAX_DEPTH = 64
# Never follow a link inside the folder, never block on (or open) a special file.
_SEED_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SEED_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SEED_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# The environment of the seed phase: the image's folder, and where its copy goes.
SEED_FROM_ENV = "ROLLOUT_SEED_FROM"
SEED_TO_ENV = "ROLLOUT_SEED_TO"


class Seeding:
    """What a seed copy did: entries left out (path, why) and, when it stopped early, why."""

    def __init__(self) -> None:
        self.skipped: list = []
        self.cut: str | None = None
        self.entries = 0
        self.bytes = 0

    def summary(self) -> str:
        shown = ", ".join(f"{why} {path!a}" for path, why in self.skipped[:10])
        parts = [f"seeded {self.entries} entries, {self.bytes} bytes"]
        if self.skipped:
            parts.append(f"skipped {len(self.skipped)} ({shown})")
        if self.cut:
            parts.append(self.cut)
        return "; ".join(parts)


def seed(source: str, dest: str) -> int:
    """Copy the folder `source` (the image's workdir: a link in its own path is the image's
    and is followed) into the existing folder `dest`. Exit status: 0, or EXIT_EPISODE_ERROR
    when the image has no such folder (locally the same task is refused at its start)."""
    done = Seeding()
    try:
        src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        # The termination message carries it to the row: neither the agent nor the grader runs.
        cause = f"the image's workdir {source!r} is not a folder: {exc.strerror}"
        record_outcome(emit("error", kind="episode", cause=cause))
        return EXIT_EPISODE_ERROR
    try:
        dst = os.open(dest, _SEED_DIR)
        try:
            _seed_dir(src, dst, "", 1, done)
            # The volume's own folder belongs to root (the Pod's fsGroup can write it): its
            # mode stays the kubelet's.
            with contextlib.suppress(OSError):
                _seed_meta(os.fstat(src), dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    print(done.summary(), file=sys.stderr)
    return 0


def _seed_dir(src: int, dst: int, prefix: str, depth: int, done: Seeding) -> None:
    try:
        with os.scandir(src) as found:
            names = []
            for entry in found:  # no more names than the copy may still take
                names.append(entry.name)
                if len(names) > SEED_MAX_ENTRIES - done.entries:
                    break
    except OSError:
        done.skipped.append((prefix or ".", "unreadable"))
        return
    for name in names:
        path = prefix + name
        done.entries += 1
        if done.entries > SEED_MAX_ENTRIES:
            done.cut = f"stopped at {SEED_MAX_ENTRIES} entries: not copied from {path!a} on"
            return
        try:
            _seed_entry(src, dst, name, path, depth, done)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                done.cut = f"stopped: {exc.strerror} at {path!a}"
            else:
                done.skipped.append((path, f"not copied ({exc.strerror})"))
        if done.cut:
            return


def _seed_entry(src: int, dst: int, name: str, path: str, depth: int, done: Seeding) -> None:
    st = os.stat(name, dir_fd=src, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
    elif stat.S_ISDIR(st.st_mode):
        if depth > SEED_MAX_DEPTH:
            done.skipped.append((path, "too deep"))
            return
        sub_src = os.open(name, _SEED_DIR, dir_fd=src)
        try:
            os.mkdir(name, 0o700, dir_fd=dst)
            sub_dst = os.open(name, _SEED_DIR, dir_fd=dst)
            try:
                _seed_dir(sub_src, sub_dst, path + "/", depth + 1, done)
                _seed_meta(os.fstat(sub_src), sub_dst)
            finally:
                os.close(sub_dst)
        finally:
            os.close(sub_src)
    elif stat.S_ISREG(st.st_mode):
        if done.bytes + st.st_size > SEED_MAX_BYTES:
            done.cut = f"stopped at {SEED_MAX_BYTES} bytes: not copied from {path!a} on"
        elif not _seed_file(src, dst, name, done):
            done.skipped.append((path, "changed while copied"))
    else:
        done.skipped.append((path, "special file"))


def _seed_file(src: int, dst: int, name: str, done: Seeding) -> bool:
    """One regular file; False when what `name` opened is no regular file any more."""
    source = os.open(name, _SEED_READ, dir_fd=src)
    try:
        st = os.fstat(source)
        if not stat.S_ISREG(st.st_mode):
            return False
        target = os.open(name, _SEED_WRITE, 0o600, dir_fd=dst)
        try:
            left = st.st_size
            while left > 0:
                sent = os.sendfile(target, source, None, min(left, 2**20))
                if sent == 0:
                    break
                left -= sent
                done.bytes += sent
            _seed_meta(st, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dst)  # no half copy
            raise
        finally:
            os.close(target)
    finally:
        os.close(source)
    return True


def _seed_meta(st: os.stat_result, fd: int) -> None:
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)  # no setuid, setgid or sticky bit
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))

"""The on-disk layout of a local run, shared by the backend (workers) and its supervisor."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

OWNER = "rollout"
# MAX_LOG_BYTES is what one episode may print (its stdout, the protocol's events). Past it the
# supervisor stops the episode and ends its log with LOG_CUT_MARK, so a flood never fills the
# disk or a reader.
LOG_CUT_MARK = b"\n[rollout: output cut at %d bytes: the episode printed more and was stopped]\n"
# The host's copies of what a sandbox left (an agent's workspace for its `fresh` grader, an
# image's WORKDIR) stop here: a workspace of junk cannot fill the host's disk.
COPY_MAX_BYTES = 2**30
COPY_MAX_ENTRIES = 100_000
# Folders nested deeper are skipped: the copy holds two descriptors per level.
COPY_MAX_DEPTH = 64
_COPY_CHUNK = 2**20
# Never follow a link, never block on (or open) a special file.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class RunDir:
    """<local_root>/<batch_id>/: run.json, program/, logs/<i>.log, status/<i>.json, ws/<i>/."""

    def __init__(self, path: Path) -> None:
        self.path = path

    run_file = property(lambda self: self.path / "run.json")
    finished_file = property(lambda self: self.path / "finished.json")
    lock_file = property(lambda self: self.path / "supervisor.lock")
    pid_file = property(lambda self: self.path / "supervisor.pid")
    supervisor_log = property(lambda self: self.path / "supervisor.log")
    program = property(lambda self: self.path / "program" / "episode.py")

    def log(self, index: int) -> Path:
        return self.path / "logs" / f"{index}.log"

    def stderr(self, index: int) -> Path:
        return self.path / "logs" / f"{index}.err"

    def attempt_log(self, index: int, attempt: int, kind: str = "log") -> Path:
        """The log (or stderr, kind "err") of an earlier attempt, kept after its retry."""
        return self.path / "logs" / f"{index}.attempt{attempt}.{kind}"

    def attempts(self, index: int) -> Path:
        return self.path / "status" / f"{index}.attempts.json"

    def status(self, index: int) -> Path:
        return self.path / "status" / f"{index}.json"

    def workspace(self, index: int) -> Path:
        return self.path / "ws" / str(index)

    def read_json(self, path: Path) -> dict[str, Any] | None:
        try:
            value = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        return value if isinstance(value, dict) else None


def write_json_atomic(path: Path, value: Any) -> None:
    """Readers see the old file or the whole new one, never a torn write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(orjson.dumps(value))
    os.replace(tmp, path)


def create_json_exclusive(path: Path, value: Any) -> bool:
    """Create `path` with `value` unless it exists; True when this call created it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(orjson.dumps(value))
    try:
        os.link(tmp, path)  # atomic create-if-absent, with the content already in place
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def spawn_detached(module: str, path: Path) -> None:
    """Start `python -m <module> --daemonize <path>` (a supervisor or a pool process): it
    outlives the caller. Raises OSError or SubprocessError when it cannot be started."""
    subprocess.run(
        [sys.executable, "-m", module, "--daemonize", str(path)],
        check=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def daemonize(log_path: Path) -> bool:
    """Detach this process (`--daemonize`): double fork, so the caller reaps the first child
    at once, the daemon is adopted by init and no zombie is left in a Celery worker; stdout and
    stderr go to `log_path`. True in the daemon, False in the caller (which returns)."""
    if os.fork() > 0:
        return False
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    return True


@dataclass
class TreeCopy:
    """What copy_tree did: the entries it did not copy (path, why) and, when it stopped
    before the end, why."""

    skipped: list[tuple[str, str]] = field(default_factory=list)
    cut: str | None = None
    entries: int = 0
    bytes: int = 0

    def summary(self, shown: int = 10) -> str | None:
        """One line for a log (None: all was copied). Names are the sandbox's: escaped, so
        none can start a line of its own."""
        parts = []
        if self.skipped:
            listed = ", ".join(f"{why} {path!a}" for path, why in self.skipped[:shown])
            more = f" and {len(self.skipped) - shown} more" if len(self.skipped) > shown else ""
            parts.append(f"skipped {len(self.skipped)} entries ({listed}{more})")
        if self.cut:
            parts.append(self.cut)
        return "; ".join(parts) or None


def copy_tree(
    source: Path,
    dest: Path,
    *,
    max_bytes: int = COPY_MAX_BYTES,
    max_entries: int = COPY_MAX_ENTRIES,
    max_depth: int = COPY_MAX_DEPTH,
) -> TreeCopy:
    """Copy the folder `source`, which a sandbox wrote, to the new folder `dest`: folders and
    regular files (their mode bits without setuid, their times), links as links (never
    followed), never a FIFO, socket or device (skipped and listed). Walks by descriptors with
    O_NOFOLLOW, so no link in a path leads the host elsewhere. Never raises for what it finds:
    what it cannot read is listed; past `max_bytes` or `max_entries` it stops (`cut`)."""
    result = TreeCopy()
    os.mkdir(dest, 0o700)
    dst = os.open(dest, _DIR_FLAGS)
    try:
        try:
            src = os.open(source, _DIR_FLAGS)
        except OSError:
            result.skipped.append((".", "not a directory"))
            os.fchmod(dst, 0o755)
            return result
        try:
            _copy_dir(src, dst, "", 1, result, (max_bytes, max_entries, max_depth))
            _copy_meta(os.fstat(src), dst)
        finally:
            os.close(src)
    finally:
        os.close(dst)
    return result


def _copy_dir(
    src: int, dst: int, prefix: str, depth: int, result: TreeCopy, limits: tuple[int, int, int]
) -> None:
    max_bytes, max_entries, max_depth = limits
    try:
        # Read no more names than the copy may still take (a folder of millions of entries
        # is not held in memory).
        with os.scandir(src) as found:
            names = [e.name for e in itertools.islice(found, max_entries - result.entries + 1)]
    except OSError:
        result.skipped.append((prefix or ".", "unreadable"))
        return
    for name in names:
        path = prefix + name
        result.entries += 1
        if result.entries > max_entries:
            result.cut = f"copy stopped at {max_entries} entries: not copied from {path!a} on"
            return
        try:
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
                os.utime(
                    name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False
                )
            elif stat.S_ISDIR(st.st_mode):
                if depth > max_depth:
                    result.skipped.append((path, "too deep"))
                    continue
                _copy_subdir(src, dst, name, path, depth, result, limits)
                if result.cut:
                    return
            elif stat.S_ISREG(st.st_mode):
                if result.bytes + st.st_size > max_bytes:
                    result.cut = f"copy stopped at {max_bytes} bytes: not copied from {path!a} on"
                    return
                if not _copy_file(src, dst, name, result):
                    result.skipped.append((path, "changed while copied"))
            else:
                result.skipped.append((path, _special_kind(st.st_mode)))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the host's disk, not the entry
                result.cut = f"copy stopped: {exc.strerror} at {path!a}"
                return
            result.skipped.append((path, f"not copied ({exc.strerror})"))


def _copy_subdir(
    src: int,
    dst: int,
    name: str,
    path: str,
    depth: int,
    result: TreeCopy,
    limits: tuple[int, int, int],
) -> None:
    sub_src = os.open(name, _DIR_FLAGS, dir_fd=src)
    try:
        os.mkdir(name, 0o700, dir_fd=dst)
        sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst)
        try:
            _copy_dir(sub_src, sub_dst, path + "/", depth + 1, result, limits)
            _copy_meta(os.fstat(sub_src), sub_dst)
        finally:
            os.close(sub_dst)
    finally:
        os.close(sub_src)


def _copy_file(src: int, dst: int, name: str, result: TreeCopy) -> bool:
    """Copy one regular file; False when what `name` opened is no regular file any more."""
    source = os.open(name, _READ_FLAGS, dir_fd=src)
    try:
        st = os.fstat(source)  # what was opened, not what was looked up before
        if not stat.S_ISREG(st.st_mode):
            return False
        target = os.open(name, _WRITE_FLAGS, 0o600, dir_fd=dst)
        try:
            left = st.st_size  # a file that grows meanwhile is copied to its size then
            while left > 0:
                sent = os.sendfile(target, source, None, min(left, _COPY_CHUNK))
                if sent == 0:
                    break
                left -= sent
                result.bytes += sent
            _copy_meta(st, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dst)  # no half copy for the grader
            raise
        finally:
            os.close(target)
    finally:
        os.close(source)
    return True


def _copy_meta(st: os.stat_result, fd: int) -> None:
    # No setuid, setgid or sticky bit: the copy is the host's, owned by the host's user.
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


# Linux's own bound on the links one path lookup follows.
MAX_LINKS = 40


def resolve_in_root(root: Path, path: str) -> str:
    """`path` (an image's WORKDIR) as the image sees it, with `root` (its exported filesystem)
    as /: links are followed inside `root` only (an absolute one restarts at `root`, `..`
    stops there), never on the host. The real folder it names, as an absolute path inside
    the image; ValueError when it is none or its links loop."""
    resolved: list[str] = []  # each a real folder (no link) below root
    todo = [part for part in reversed(path.split("/")) if part]
    links = 0
    while todo:
        part = todo.pop()
        if part == ".":
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        here = root.joinpath(*resolved, part)
        try:
            st = os.lstat(here)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise ValueError(f"the image's WORKDIR {path!r} has links that loop")
                target = os.readlink(here)
                if target.startswith("/"):
                    resolved = []
                todo.extend(p for p in reversed(target.split("/")) if p)
                continue
        except OSError as exc:
            raise ValueError(f"the image's WORKDIR {path!r} is not in its root: {exc}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"the image's WORKDIR {path!r} is not a directory in its root")
        resolved.append(part)
    return "/" + "/".join(resolved)


# sockaddr_un's sun_path: 108 bytes with the terminating NUL.
SUN_PATH_MAX = 108


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An AF_UNIX address for `path` to bind or connect to within the block, however deep its
    folder: a run's, a pool's or a host's folders easily pass sun_path's 107 bytes. Past them
    the folder is reached through a descriptor of it, /proc/self/fd/N/<name>."""
    if len(os.fsencode(path)) < SUN_PATH_MAX:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)

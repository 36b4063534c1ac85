"""A task's artifacts (Harbor's top-level `artifacts`): the files it lists, read from the
sandbox after the tests into the reward event (so into the episode's log, a record of the
batch), bounded, never through a link, what is refused named."""

from __future__ import annotations

import errno
import os
import stat

MAX_ARTIFACT_FILES = 50
MAX_ARTIFACT_FILE_BYTES = 256 * 1024
MAX_ARTIFACTS_BYTES = 1024 * 1024
MAX_ARTIFACT_DEPTH = 8
MAX_ARTIFACT_REFUSALS = 50


def shown_path(path: str) -> str:
    """A sandbox's path for a record: escaped (no control character starts a line of its
    own) and cut."""
    text = ascii(path)[1:-1]
    return text if len(text) <= 200 else text[:197] + "..."


class Collected:
    """What collect_artifacts found: the files (as records) and what it refused, and why."""

    def __init__(self) -> None:
        self.files: list = []
        self.refused: list = []
        self.total = 0

    def refuse(self, path: str, why: str) -> None:
        if len(self.refused) < MAX_ARTIFACT_REFUSALS:
            self.refused.append(f"{shown_path(path)}: {why}")

    def add(self, path: str, fd: int, size: int) -> None:
        if len(self.files) >= MAX_ARTIFACT_FILES:
            self.refuse(path, f"over the {MAX_ARTIFACT_FILES} files an episode keeps")
            return
        if size > MAX_ARTIFACT_FILE_BYTES:
            self.refuse(path, f"{size} bytes, above the {MAX_ARTIFACT_FILE_BYTES} a file may have")
            return
        if self.total + size > MAX_ARTIFACTS_BYTES:
            self.refuse(path, f"over the {MAX_ARTIFACTS_BYTES} bytes an episode's artifacts keep")
            return
        data = os.read(fd, MAX_ARTIFACT_FILE_BYTES + 1)
        if len(data) > MAX_ARTIFACT_FILE_BYTES:  # grew since fstat
            self.refuse(path, f"above the {MAX_ARTIFACT_FILE_BYTES} bytes a file may have")
            return
        # Here, not at the top: hashlib starts OpenSSL (about 11 M instructions of a runner's
        # start), which an episode without artifacts never needs.
        import base64
        import hashlib

        self.total += len(data)
        record: dict = {
            "path": shown_path(path),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        try:
            if b"\0" in data:
                raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL byte")
            record["text"] = data.decode("utf-8")
        except UnicodeDecodeError:
            record["base64"] = base64.b64encode(data).decode("ascii")
        self.files.append(record)


def _open_parent(path: str) -> tuple[int, str]:
    """(a descriptor of `path`'s folder reached from / without following any link, the last
    name); OSError (ELOOP, ENOTDIR, ENOENT) when a component is a link or missing."""
    parts = [part for part in path.split("/") if part]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            next_fd = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except OSError:
        os.close(fd)
        raise
    return fd, parts[-1] if parts else "."


def _open_entry(found: Collected, path: str, name: str, parent: int, flags: int) -> int | None:
    """The entry opened read-only, never through a link; None (refused, with why) when not."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags, dir_fd=parent)
    except OSError as exc:
        found.refuse(path, exc.strerror or "cannot be read")
        return None


def _take(found: Collected, path: str, parent: int, name: str, depth: int) -> None:
    """The entry `name` of the folder `parent`: a file read, a folder walked, else refused."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError as exc:
        found.refuse(path, exc.strerror or "cannot be read")
        return
    if stat.S_ISLNK(info.st_mode):
        found.refuse(path, "a symbolic link (never followed)")
    elif stat.S_ISREG(info.st_mode):
        fd = _open_entry(found, path, name, parent, os.O_NONBLOCK)
        if fd is None:
            return
        try:
            size = os.fstat(fd).st_size
            found.add(path, fd, size)
        finally:
            os.close(fd)
    elif stat.S_ISDIR(info.st_mode):
        if depth >= MAX_ARTIFACT_DEPTH:
            found.refuse(path, f"deeper than the {MAX_ARTIFACT_DEPTH} folders walked")
            return
        fd = _open_entry(found, path, name, parent, os.O_DIRECTORY)
        if fd is None:
            return
        try:
            names = sorted(os.listdir(fd))[: MAX_ARTIFACT_FILES + MAX_ARTIFACT_REFUSALS]
            for child in names:
                _take(found, f"{path.rstrip('/')}/{child}", fd, child, depth + 1)
        finally:
            os.close(fd)
    else:
        found.refuse(path, "not a file or folder (a FIFO, socket or device is never opened)")


def collect_artifacts(paths: list, root: str) -> dict:
    """The reward event's `artifacts` (each file: path, bytes, sha256, text or base64) and
    `artifacts_refused` ("path: why") of the task's listed `paths` (absolute, or relative to
    the workspace `root`), read without following a link anywhere on the way."""
    found = Collected()
    for listed in paths:
        path = str(listed) if str(listed).startswith("/") else os.path.join(root, str(listed))
        try:
            parent, name = _open_parent(path)
        except OSError as exc:
            linked = exc.errno in (errno.ELOOP, errno.ENOTDIR)
            why = "a folder on the way is a symbolic link (never followed) or no folder"
            found.refuse(str(listed), why if linked else exc.strerror or "cannot be reached")
            continue
        try:
            _take(found, str(listed), parent, name, 0)
        finally:
            os.close(parent)
    return {"artifacts": found.files, "artifacts_refused": found.refused}

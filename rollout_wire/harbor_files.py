"""Reading a Harbor task folder (`rollout_wire.harbor`) as hostile input.

A task folder is hostile input: it is read without following any symbolic link (a link could
carry a host file, /etc/passwd or ~/.ssh, into the statement, Redis and a ConfigMap) and
without opening FIFOs, devices or sockets (reading one blocks or reaches the host). Each is
refused, naming the task and the path.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

TASK_TOML = "task.toml"
INSTRUCTION = "instruction.md"
TEST_SCRIPT = "test.sh"
# Tasks travel inside the batch request (< 1 MiB in all), so any one file must be smaller.
MAX_FILE_BYTES = 1024 * 1024
# Clutter that is never part of a task (editors, VCS, bytecode).
SKIPPED = frozenset({".git", "__pycache__", ".DS_Store", ".gitkeep"})
_LITERAL_PATH = re.compile(r"^/[^\s$\"'\\`]*$")
LINK_WHY = "; a task folder is read without following links (it could name a host file)"


def kind_of(path: Path) -> str:
    """What is at `path`, the last component not followed: missing, link, dir, file, or
    special (FIFO, device, socket)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "special"


def is_kind(path: Path, name: str, want: str, where: str, problems: list[str]) -> bool:
    """Whether `path` is a `want` ("file" or "dir"); otherwise a problem naming it."""
    kind = kind_of(path)
    if kind == want:
        return True
    if kind == "link":
        problems.append(f"{where}: {name} is a symbolic link{LINK_WHY}")
    elif kind == "missing":
        problems.append(f"{where}: no {name}")
    else:
        problems.append(f"{where}: {name} is not a plain {'file' if want == 'file' else 'folder'}")
    return False


def has_folder(path: Path, name: str, where: str, problems: list[str]) -> bool:
    """Whether the task has this folder: False when it has none, and a problem too when it is a
    link or not a folder."""
    return kind_of(path) != "missing" and is_kind(path, name, "dir", where, problems)


def read_text(path: Path, where: str, problems: list[str], name: str | None = None) -> str | None:
    """A file's text, or a problem naming it: only text below MAX_FILE_BYTES travels."""
    name = name or path.name
    # O_NOFOLLOW: a file swapped for a link after it was checked is still not followed;
    # O_NONBLOCK: nor does a FIFO block the open (fstat refuses it).
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            problems.append(f"{where}: {name} is a symbolic link{LINK_WHY}")
        else:
            problems.append(f"{where}: {name} cannot be read: {exc.strerror}")
        return None
    with open(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            problems.append(f"{where}: {name} is not a plain file")
            return None
        size = info.st_size
        if size > MAX_FILE_BYTES:
            problems.append(f"{where}: {name} is {size} bytes, above the {MAX_FILE_BYTES} allowed")
            return None
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # grew since fstat
        problems.append(f"{where}: {name} is above the {MAX_FILE_BYTES} bytes allowed")
        return None
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), len(data), "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        problems.append(f"{where}: {name} is a binary file; only UTF-8 text can be carried")
        return None


def dockerfile_workdir(text: str) -> str | None:
    """The last WORKDIR of a Dockerfile's final stage when it is an absolute, literal path;
    None otherwise (none, relative, quoted, or using $VAR/ARG substitution), since only a
    path known without building the image can be given to both backends."""
    workdir: str | None = None
    # A line ending in a backslash continues on the next: joined first.
    for line in re.sub(r"\\[ \t]*\r?\n", " ", text).splitlines():
        words = line.split(None, 1)
        if not words:
            continue
        instruction = words[0].upper()
        if instruction == "FROM":
            workdir = None  # a new stage starts from its base's WORKDIR, unknown here
        elif instruction == "WORKDIR":
            value = words[1].strip() if len(words) > 1 else ""
            # "/app/" is /app; "/" is no workdir of the task's own (the backend's default).
            workdir = (value.rstrip("/") or None) if _LITERAL_PATH.match(value) else None
    return workdir


def walk(root: Path) -> Iterable[tuple[str, Path]]:
    """(relative posix path, path) of every entry below `root`, sorted, clutter left out; no
    symbolic link is followed."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED)
        base = Path(dirpath)
        for name in sorted([*dirnames, *filenames]):
            if name not in SKIPPED:
                yield (base / name).relative_to(root).as_posix(), base / name


def read_tree(root: Path, where: str, problems: list[str], read: bool = True) -> dict[str, str]:
    """path -> text of every file below `root` (a folder of the task, itself no link), links
    and special files refused; `read=False` only checks."""
    files: dict[str, str] = {}
    for rel, path in walk(root):
        name = f"{root.name}/{rel}"
        kind = kind_of(path)
        if kind == "link":
            problems.append(f"{where}: {name} is a symbolic link{LINK_WHY}")
        elif kind == "special":
            problems.append(f"{where}: {name} is not a plain file")
        elif kind == "file" and read:
            text = read_text(path, where, problems, name)
            if text is not None:
                files[rel] = text
    return files

"""Files in the workspace and the grading folders: written, emptied, never through a link."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile


def workspace_path(root: str, path: object) -> str:
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        raise ValueError(f"path must be a relative path in the repository, got {path!r}")
    full = os.path.realpath(os.path.join(root, path))
    if full != root and not full.startswith(root + os.sep):
        raise ValueError(f"path {path!r} leaves the repository")
    return full


def _writable_dir(path: str) -> None:
    """`path` a real directory the runner can write (an agent may have left a link, a file or
    a read-only directory there)."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    if not os.path.isdir(path):
        os.mkdir(path)
    elif not os.access(path, os.W_OK | os.X_OK):
        os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | stat.S_IRWXU)


def write_files(root: str, files: dict, scripts: bool = False) -> None:
    """Write `files` (relative path -> text) under `root`. Whatever is in the way is removed,
    so each text lands where it is named and never through a link out of `root`. With
    `scripts`, a text starting with #! is made executable (texts carry no file modes)."""
    for path, text in files.items():
        parts = path.split("/") if isinstance(path, str) and "\0" not in path else []
        if not parts or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"path must be a relative path in the repository, got {path!r}")
        current = root
        for part in parts[:-1]:
            current = os.path.join(current, part)
            _writable_dir(current)
        full = os.path.join(current, parts[-1])
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        elif os.path.lexists(full):
            os.unlink(full)
        with open(full, "w") as handle:
            handle.write(text)
        if scripts and text.startswith("#!"):
            os.chmod(full, 0o755)


def empty_folder(path: str) -> None:
    """Remove everything in the folder `path` (never following a link), making writable on
    the way what the agent made unwritable; OSError when something stays."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            for folder, dirs, _ in os.walk(full):
                for name in [".", *dirs]:
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
            shutil.rmtree(full)
        else:
            os.unlink(full)


def fresh_dir(path: str, prefix: str) -> str:
    """`path` emptied (made when missing), or a new temporary directory when it cannot be:
    nothing an agent left there (a planted reward file, a link) reaches the grading."""
    try:
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
        empty_folder(path)
        if os.access(path, os.W_OK | os.X_OK) and not os.listdir(path):
            return path
    except OSError:
        pass
    return tempfile.mkdtemp(prefix=prefix)


def remove_special_files(root: str) -> None:
    """FIFOs, sockets and devices under `root` removed (a test that opens a FIFO would hang):
    a `fresh` grader receives files, folders and links, as a local copy does."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                    os.unlink(path)

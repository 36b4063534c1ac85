"""The on-disk layout of a local run, shared by the backend (workers) and its supervisor."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

OWNER = "rollout"
# MAX_LOG_BYTES is what one episode may print (its stdout, the protocol's events). Past it the
# supervisor stops the episode and ends its log with LOG_CUT_MARK, so a flood never fills the
# disk or a reader.
LOG_CUT_MARK = b"\n[rollout: output cut at %d bytes: the episode printed more and was stopped]\n"


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

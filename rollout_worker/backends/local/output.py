"""A running sandbox and what it prints: its log (cut at MAX_LOG_BYTES, the sandbox killed
there) and the event lines the supervisor acts on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from rollout_wire.states import EventKind, event_mark
from rollout_worker.backends.base import MAX_LOG_BYTES
from rollout_worker.backends.local.files import LOG_CUT_MARK
from rollout_worker.backends.local.phases import AGENT_PHASE
from rollout_worker.backends.local.pool import Taken

# The longest partial output line a sandbox may hold before its newline.
PENDING_LIMIT = 64 * 2**10
# The event lines the supervisor acts on, as the bytes a log line holds.
READY_LINE = event_mark(EventKind.READY).encode()
REWARD_LINE = event_mark(EventKind.REWARD).encode()
GRADE_PENDING_LINE = event_mark(EventKind.GRADE_PENDING).encode()
ERROR_LINE = event_mark(EventKind.ERROR).encode()


@dataclass
class Running:
    index: int
    proc: subprocess.Popen[bytes] | None  # None: a warm sandbox (the pool is its parent)
    pidfd: int
    out: int  # read end of the sandbox's stdout
    log: BinaryIO
    created_at: float
    attempt: int
    deadline: float
    killed_for: str | None = None
    pending: bytes = b""
    done: bool = False
    written: int = 0  # bytes of its log so far (capped at MAX_LOG_BYTES)
    warm: Taken | None = None  # taken from a warm pool (local/pool.py)
    phase: str = AGENT_PHASE  # or GRADE_PHASE: the second sandbox of an agent's episode
    grade_pending: bool = False  # its runner said: grade me in a second sandbox

    @property
    def pid(self) -> int:
        return self.warm.pid if self.warm is not None else self.proc.pid  # type: ignore[union-attr]

    def kill(self, why: str) -> None:
        """Kill its process group, once; `why` becomes its end's reason."""
        if self.killed_for is None:
            self.killed_for = why
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)


def read_output(item: Running) -> list[bytes] | None:
    """Copy what the sandbox printed into its log; the whole lines it completed (events may
    be among them). None at EOF."""
    try:
        data = os.read(item.out, 65536)
    except BlockingIOError:
        return []
    if not data:
        return None
    room = MAX_LOG_BYTES - item.written
    if room <= 0:
        return []  # cut already: drain and drop until the stopped sandbox closes
    if len(data) >= room:  # the limit is reached: cut here, whatever would follow
        item.log.write(data[:room] + LOG_CUT_MARK % MAX_LOG_BYTES)
        item.written = MAX_LOG_BYTES
        item.kill("LogLimitExceeded")
    else:
        item.log.write(data)
        item.written += len(data)
    item.log.flush()
    # Only whole short lines can be events: a line longer than this is never one.
    lines = (item.pending[-PENDING_LIMIT:] + data).split(b"\n")
    item.pending = lines.pop()[-PENDING_LIMIT:]
    return lines


def error_cause(log_path: Path) -> str | None:
    """The cause the runner gave in its (last) error event, if it printed one."""
    cause = None
    with contextlib.suppress(OSError), open(log_path, "rb") as log:
        for line in log:
            if ERROR_LINE in line:
                with contextlib.suppress(orjson.JSONDecodeError):
                    event = orjson.loads(line)
                    if isinstance(event, dict) and event.get("cause"):
                        cause = str(event["cause"])
    return cause

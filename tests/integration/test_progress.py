"""Live progress while a 100-episode batch runs, as a user sees it in a terminal or a log."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.workers]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
COMMAND = [
    sys.executable,
    "-m",
    "rollout_worker.cli",
    "run",
    "--count",
    "100",
    "--parallelism",
    "10",
    "--all-in-one",
]


def test_a_terminal_sees_the_progress_table_redrawn_as_episodes_advance():
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(
        COMMAND,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color"},
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(60) == 0
    screen = ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    batch = re.search(r"batch (\w+): 100 episodes submitted", screen).group(1)
    # Rows of the live table: batch | pending | running | ready | rewarded | ok | failed | lost
    rows = {
        tuple(int(n) for n in m.groups())
        for m in re.finditer(
            re.escape(batch) + r"\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*(\d+)",
            screen,
        )
    }
    assert len(rows) >= 5, rows  # redrawn many times while the batch ran
    assert any(
        pending > 0 and running + ready + rewarded > 0
        for pending, running, ready, rewarded, _ in rows
    ), rows
    assert (0, 0, 0, 0, 100) in rows  # the last frame: everything collected, all ok
    assert "successful_episodes" in screen and "reward_sum" in screen


def test_a_log_gets_one_progress_line_per_second():
    done = subprocess.run(COMMAND, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if ": pending=" in line]
    assert len(lines) >= 2, done.stderr
    assert lines[-1].split(": ", 1)[1].startswith("pending=0 running=0 ready=0 rewarded=0 ok=100")

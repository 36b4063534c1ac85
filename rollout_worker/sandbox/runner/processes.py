"""Processes: commands run in their own group, the agent run to its limit, leftovers
killed, the runner hardened against its agent."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing

from .cost import time_allowed
from .errors import EpisodeError

KILL_GRACE_SECONDS = 2.0
OUTPUT_TAIL_LINES = 20
OUTPUT_TAIL_BYTES = 4096
MAX_TESTS_OUTPUT = 8 * 2**20


def resolve_argv(argv: list, path: str) -> list:
    """argv with its program found: `python`/`python3` is this interpreter, a bare name is
    looked up on `path` (`bash` falls back to `sh`: alpine images have no bash)."""
    first = argv[0]
    if first in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if "/" in first:
        return list(argv)
    found = shutil.which(first, path=path)
    if found is None and first == "bash":
        found = shutil.which("sh", path=path)
    if found is None:
        raise EpisodeError(f"{first!r} is not on the sandbox's PATH ({path})")
    return [found, *argv[1:]]


def run_process(
    argv: list, env: dict, cwd: str, timeout: float, pass_fds: tuple = ()
) -> tuple[int, str, set]:
    """(exit code, output, the processes still running when it ended) of a command in its own
    process group, output to a file: a grandchild that keeps running (a test's server) neither
    holds a pipe open nor survives."""
    handle, output_path = tempfile.mkstemp(prefix="rollout-run-", suffix=".log")
    try:
        try:
            process = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
                pass_fds=pass_fds,
            )
        except OSError as exc:
            raise EpisodeError(f"{argv[0]!r} could not start: {exc}") from None
        finally:
            os.close(handle)
        code = wait_exit(process, timeout)
        # What the command left running is killed here, by us: it did not end by itself.
        alive = set(descendants(os.getpid()))
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        if code is None:
            process.kill()
            process.wait()
        with open(output_path, "rb") as out:
            output = out.read(MAX_TESTS_OUTPUT).decode("utf-8", "replace")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(output_path)
    if code is None:
        return 124, output + f"\n[tests timed out after {timeout:.0f}s]", alive
    return code, output, alive


def wait_exit(process: subprocess.Popen, timeout: float | None) -> int | None:
    """The exit status of `process` (reaped) once it ends, or None if it still runs after
    `timeout` seconds (None: no limit). On Linux (5.3+) its end is told on a pidfd, so it is
    noticed at once and nothing polls; elsewhere (no os.pidfd_open, or it fails) Popen.wait,
    which polls with sleeps growing to 50 ms."""
    if process.returncode is not None:
        return process.returncode  # reaped: its pid may be another process's by now
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while deadline is None or time.monotonic() < deadline:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                # In ms, never early, at most a C int's (24 days: polled again after that).
                if poller.poll(None if left is None else min(int(left * 1000) + 1, 2**31 - 1)):
                    break
        finally:
            os.close(pidfd)
        code = process.poll()
        if code is not None or (deadline is not None and time.monotonic() >= deadline):
            return code
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return process.wait(left)
    except subprocess.TimeoutExpired:
        return None


def run_command(command: str, timeout: float, env: dict) -> tuple[int, str]:
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=max(timeout, 1.0),
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.output.decode("utf-8", "replace") if exc.output else ""
        return 124, output + f"\n[command timed out after {timeout:.0f}s]"
    return done.returncode, done.stdout.decode("utf-8", "replace")


def harden() -> None:
    """Best effort (Linux): the runner adopts the orphans its agent leaves
    (PR_SET_CHILD_SUBREAPER), so kill_leftovers finds them, is not dumpable
    (PR_SET_DUMPABLE 0), so the agent, the same user, can neither open the runner's stdout
    through /proc nor trace it to print events of its own (children are dumpable again after
    exec: nothing changes for them), and, as its PID namespace's init, cannot be signalled
    away by its agent."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        pass
    if os.getpid() == 1:
        # As its namespace's init the runner gets only the signals it handles: Python's
        # SIGINT handler would let the agent end it with KeyboardInterrupt. A handler of its
        # own (not SIG_IGN, which children would inherit) keeps that door shut too.
        signal.signal(signal.SIGINT, lambda *_: None)


def descendants(pid: int) -> list:
    """The live processes below `pid`, from /proc (empty without it)."""
    children: dict = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":  # a zombie is already dead
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def reap() -> None:
    """Collect the exit status of every child that ended (orphans adopted included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_leftovers(group: int | None = None) -> None:
    """Kill what the agent left running: its process group (when given), then every process
    below the runner (the subreaper adopted those that left the group)."""
    if group is not None:
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    if os.getpid() == 1:
        # As its PID namespace's init the runner may kill(-1): that spares the caller and
        # PID 1, both the runner here. Never otherwise: outside a namespace of its own, -1
        # reaches every process of the user on the machine.
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
    for _ in range(200):  # a second at most; a killed process is usually gone in a few ms
        reap()
        found = descendants(os.getpid())
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    reap()


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM to the agent's process group, SIGKILL after KILL_GRACE_SECONDS."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(OSError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(OSError):
            process.send_signal(sig)  # in case it left its group
        if wait_exit(process, KILL_GRACE_SECONDS) is not None:
            return
    process.wait()


def output_tail(path: str) -> tuple[str, int]:
    """(the last OUTPUT_TAIL_LINES lines, at most OUTPUT_TAIL_BYTES, of a file; its size)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            handle.seek(max(0, size - OUTPUT_TAIL_BYTES))
            data = handle.read(OUTPUT_TAIL_BYTES)
    except OSError:
        return "", 0
    lines = data.decode("utf-8", "replace").splitlines()[-OUTPUT_TAIL_LINES:]
    text = "\n".join(lines).encode("utf-8")[-OUTPUT_TAIL_BYTES:]
    return text.decode("utf-8", "ignore"), size


def run_agent(
    argv: list, env: dict, cwd: str, time_limit: float, stop: threading.Event
) -> dict[str, typing.Any]:
    """Run the agent command to its end, its time (`time_allowed`), or `stop`; then kill
    what it left. The agent_exit event's fields."""
    handle, output = tempfile.mkstemp(prefix="rollout-agent-", suffix=".log")
    started = time.time()
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        os.unlink(output)
        raise EpisodeError(f"the agent command {argv[0]!r} could not start: {exc}") from None
    finally:
        os.close(handle)
    timed_out = False
    while process.poll() is None:
        left = started + time_allowed(time_limit) - time.time()
        if left <= 0:
            timed_out = True
            break
        if stop.wait(min(0.1, left)):
            break
    if process.poll() is None:
        stop_process(process)
    seconds = time.time() - started
    kill_leftovers(process.pid)
    tail, size = output_tail(output)
    with contextlib.suppress(OSError):
        os.unlink(output)
    return {
        "exit_code": None if timed_out else process.returncode,
        "timed_out": timed_out,
        "seconds": seconds,
        "output_tail": tail,
        "output_bytes": size,
    }

"""run_process waits for its command's end on a pidfd (issue 43): told by the kernel, not
polled for with Popen.wait's sleeps of up to 50 ms; the exit status, output, timeout kill of
the process group and the processes left running are as before, with or without a pidfd."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

import pytest

from rollout_worker.sandbox.runner import processes


def pidfd_works() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


@pytest.fixture(params=["pidfd", "no pidfd_open", "pidfd_open fails"])
def way(request, monkeypatch):
    """Each test under the pidfd (where the kernel has it) and under both fallbacks."""
    if request.param == "pidfd" and not pidfd_works():
        pytest.fail("no pidfd_open here: this machine must have it (Linux 5.3+)")
    if request.param == "no pidfd_open":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    if request.param == "pidfd_open fails":

        def refused(pid: int, flags: int = 0) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    return request.param


def run(code: str, timeout: float = 30.0, subreaper: bool = False) -> tuple[int, str, set]:
    """run_process from a forked process of its own: what it finds still running below it is
    then the command's alone (pytest's own children, a stack a fixture keeps, are not); with
    `subreaper`, that process adopts its orphans as the runner does (harden)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read)
            if subreaper and ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) != 0:  # CHILD_SUBREAPER
                raise OSError("no PR_SET_CHILD_SUBREAPER here")
            argv = [sys.executable, "-c", code]
            found, output, alive = processes.run_process(argv, dict(os.environ), "/", timeout)
            os.write(write, json.dumps([found, output, sorted(alive)]).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as handle:
        data = handle.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, "the forked run failed"
    found, output, alive = json.loads(data)
    return found, output, set(alive)


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether `pid` is dead (gone, or a zombie its new parent has not reaped yet)."""
    end = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except (OSError, IndexError):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def test_a_quick_exit_gives_its_code_and_output_and_leaves_nothing(way):
    code, output, alive = run("import sys; print('out'); print('err', file=sys.stderr); exit(3)")
    assert code == 3
    assert output.splitlines() == ["out", "err"]
    assert alive == set()


def test_a_timeout_kills_the_process_group_and_names_what_ran(way):
    started = time.monotonic()
    code, output, alive = run(
        "import subprocess, time; print('started', flush=True);"
        "child = subprocess.Popen(['sleep', '30']); print(child.pid, flush=True);"
        "time.sleep(30)",
        timeout=1.0,
    )
    assert time.monotonic() - started < 10
    assert code == 124
    lines = output.splitlines()
    assert lines[0] == "started" and lines[-1] == "[tests timed out after 1s]"
    grandchild = int(lines[1])
    assert grandchild in alive  # with the command itself
    assert all(gone(pid) for pid in alive)


def test_a_child_that_closes_its_output_early_is_waited_for_to_its_end(way):
    started = time.monotonic()
    code, output, alive = run(
        "import os, time; print('before', flush=True); os.close(1); os.close(2);"
        "time.sleep(0.5); os._exit(5)"
    )
    assert time.monotonic() - started >= 0.5
    assert (code, output, alive) == (5, "before\n", set())


def test_a_grandchild_holding_the_output_open_neither_delays_nor_outlives_the_run(way):
    started = time.monotonic()
    code, output, alive = run(
        "import subprocess; child = subprocess.Popen(['sleep', '30']); print(child.pid)",
        subreaper=True,
    )
    assert time.monotonic() - started < 10  # the run ends with its command, not the sleep
    assert code == 0
    grandchild = int(output.split()[0])
    assert alive == {grandchild}  # still running when the command ended: killed with it
    assert gone(grandchild)


def test_extra_descriptors_still_reach_the_command(way):
    read, write = os.pipe()
    try:
        code, _, _ = processes.run_process(
            [sys.executable, "-c", f"import os; os.write({write}, b'seen')"],
            dict(os.environ),
            "/",
            30.0,
            (write,),
        )
        os.close(write)
        write = -1
        assert code == 0 and os.read(read, 100) == b"seen"
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def test_the_end_is_told_on_a_pidfd_and_never_polled_for(monkeypatch):
    """On this machine the pidfd is the way taken: opened for the command's pid, and
    Popen.wait (whose timeout polls with sleeps) never called with a timeout; the child
    is reaped all the same."""
    if not pidfd_works():
        pytest.fail("no pidfd_open here: this machine must have it (Linux 5.3+)")
    opened: list = []
    real_open = os.pidfd_open

    def recording_open(pid: int, flags: int = 0) -> int:
        opened.append(pid)
        return real_open(pid, flags)

    timed_waits: list = []
    real_wait = subprocess.Popen.wait

    def recording_wait(self, timeout=None):
        if timeout is not None:
            timed_waits.append(timeout)
        return real_wait(self, timeout)

    started: list = []
    real_init = subprocess.Popen.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(os, "pidfd_open", recording_open)
    monkeypatch.setattr(subprocess.Popen, "wait", recording_wait)
    monkeypatch.setattr(subprocess.Popen, "__init__", recording_init)
    # In this process (the recordings are its own); what it finds running is not looked at.
    code, _, _ = processes.run_process([sys.executable, "-c", "pass"], dict(os.environ), "/", 30)
    assert code == 0
    assert [process.pid for process in started] == opened
    assert timed_waits == []
    assert started[0].returncode == 0  # reaped: no zombie left
    with pytest.raises(ChildProcessError):
        os.waitpid(started[0].pid, os.WNOHANG)


def test_wait_exit_gives_none_while_it_runs_and_the_code_once_reaped(way):
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); exit(7)"], stdin=subprocess.PIPE
    )
    try:
        assert processes.wait_exit(process, 0.05) is None
        assert process.returncode is None
        process.stdin.close()
        assert processes.wait_exit(process, 30) == 7
        assert processes.wait_exit(process, 0) == 7  # already reaped: no pid looked at
    finally:
        process.kill()
        process.wait()

"""Process accounting for benchmarks: the CPU of every process of ours that works for a batch.

What a batch costs is spread over processes that come and go: the control worker and its
prefork children, the collectors, and on the local backend a supervisor per run, double-forked
away from the worker that started it, which runs the sandboxes (bwrap and the episode inside).
A process that exits is only counted if somebody reaps it and we can read that, so:

- the benchmark process makes itself a child subreaper (PR_SET_CHILD_SUBREAPER): a daemonized
  supervisor is re-parented to it instead of to init, and so is the inner bwrap of every
  sandbox (the outer bwrap exits without reaping it; it holds the episode's CPU). `Meter.stop`
  reaps them with wait4(2), whose rusage is a process's CPU plus that of all it reaped;
- a process that lives on (a worker) is read from /proc/PID/stat: its own user+system time plus
  that of the children it reaped (cutime+cstime), before and after.

Redis is measured apart (its own process), and the benchmark's own CPU (the trainer side) is not
counted. A sampler thread watches the sandboxes while the batch runs, so a benchmark can prove
they really were bubblewrap sandboxes (own PID/user/network namespaces, uid 1000 inside).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
SUPERVISOR_MODULE = b"rollout_worker.backends.local.supervisor"


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    sid: int  # session id: a daemonized supervisor has its own session
    comm: str  # kept by a zombie, unlike its command line
    own: float  # utime + stime, seconds
    children: float  # cutime + cstime: children it has reaped (0 once it is a zombie)
    argv: tuple[bytes, ...]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


ZOMBIE = Proc(0, 0, "Z", 0, "", 0.0, 0.0, ())


def snapshot() -> dict[int, Proc]:
    procs: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if not stat:
            continue
        fields = stat.rsplit(b")", 1)[1].split()
        argv = tuple(_read(f"/proc/{name}/cmdline").split(b"\0")[:-1])
        procs[int(name)] = Proc(
            int(name),
            int(fields[1]),
            fields[0].decode(),
            int(fields[3]),
            stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace"),
            (int(fields[11]) + int(fields[12])) / TICK,
            (int(fields[13]) + int(fields[14])) / TICK,
            argv,
        )
    return procs


def descendants(procs: dict[int, Proc], roots: Iterable[int]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for proc in procs.values():
        kids.setdefault(proc.ppid, []).append(proc.pid)
    found, todo = set(), [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += kids.get(pid, [])
    return found


def is_supervisor(argv: Sequence[bytes]) -> bool:
    return SUPERVISOR_MODULE in argv


@dataclass
class SandboxEvidence:
    """What the sampler saw of the sandboxes under a run directory."""

    bwrap_pids: set[int] = field(default_factory=set)
    # Episode processes (a child of a bwrap) seen in their own PID, user and network namespace
    # with uid 1000 inside, and the host uid that 1000 maps to.
    isolated_pids: set[int] = field(default_factory=set)
    host_uids: set[int] = field(default_factory=set)
    not_isolated: list[str] = field(default_factory=list)

    def assert_bwrap(self) -> None:
        assert self.bwrap_pids, "no bwrap process was seen during the run: not sandboxed"
        assert self.isolated_pids, "no episode process was seen inside a bwrap sandbox"
        assert not self.not_isolated, self.not_isolated

    def describe(self) -> str:
        return (
            f"{len(self.bwrap_pids)} bwrap processes, {len(self.isolated_pids)} episode "
            "processes seen in their own pid/user/net namespaces as uid 1000 "
            f"(host uid {sorted(self.host_uids)})"
        )


class Sampler(threading.Thread):
    """Looks at the sandboxes under `marker` (a run root path) every `interval` seconds."""

    def __init__(
        self, marker: str, launcher_sids: set[int] | None = None, interval: float = 0.2
    ) -> None:
        super().__init__(daemon=True)
        self.launcher_sids = {os.getsid(0), *(launcher_sids or ())}
        self.marker = marker.encode()
        self.interval = interval
        self.evidence = SandboxEvidence()
        self.cpu_seconds = 0.0  # this thread's own CPU, to leave out of the trainer side
        self.supervisors: dict[int, int] = {}  # this marker's supervisors seen alive: pid -> ppid
        self._halt = threading.Event()
        self._ns = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "user", "net")}

    def run(self) -> None:
        start = time.thread_time()
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)
        self.sample()
        self.cpu_seconds = time.thread_time() - start

    def stop(self) -> SandboxEvidence:
        self._halt.set()
        self.join()
        return self.evidence

    def sample(self) -> dict[int, Proc]:
        procs = snapshot()
        # The last parent seen: the `--daemonize` launcher is reaped by the worker that ran
        # it; the supervisor itself is re-parented to us.
        self.supervisors.update(
            (p.pid, p.ppid)
            for p in procs.values()
            if is_supervisor(p.argv)
            and any(self.marker in a for a in p.argv)
            and p.sid not in self.launcher_sids  # not the launcher: its caller reaps it
        )
        bwraps = {
            p.pid
            for p in procs.values()
            if p.argv and p.argv[0].endswith(b"bwrap") and any(self.marker in a for a in p.argv)
        }
        self.evidence.bwrap_pids |= bwraps
        for pid in descendants(procs, bwraps) - bwraps:
            self._check_isolated(pid)
        return procs

    def _check_isolated(self, pid: int) -> None:
        if pid in self.evidence.isolated_pids:
            return
        try:
            ns = {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in self._ns}
            uid_map = Path(f"/proc/{pid}/uid_map").read_text().split()
        except OSError:
            return  # it ended meanwhile
        shared = [n for n in self._ns if ns[n] == self._ns[n]]
        if shared or uid_map[:1] != ["1000"]:
            self.evidence.not_isolated.append(f"pid {pid}: shares {shared}, uid_map {uid_map}")
            return
        self.evidence.isolated_pids.add(pid)
        self.evidence.host_uids.add(int(uid_map[1]))


@dataclass
class Usage:
    """CPU seconds by role over one measured window."""

    control: float = 0.0  # the control worker and its (prefork) children
    collectors: float = 0.0
    supervisors: float = 0.0  # local supervisors' own CPU
    sandboxes: float = 0.0  # bwrap and the episode processes in it
    redis: float = 0.0
    trainer: float = 0.0  # the benchmark process itself (submits, waits); never in `ours`

    @property
    def ours(self) -> float:
        return self.control + self.collectors + self.supervisors + self.sandboxes


class Meter:
    """CPU of our processes between `start()` and `stop()`.

    `roles` maps a role name (control / collectors) to the pids of long-lived roots (workers);
    everything under them counts for that role. Supervisors are found by their command line and
    must have exited (and been re-parented to us) by `stop()`; `stop()` waits for that.
    """

    def __init__(
        self,
        roles: dict[str, list[int]],
        redis_pid: int | None,
        marker: str,
        *,
        reap_orphans: bool = True,
    ) -> None:
        """`reap_orphans=False` where no supervisor runs and this process has subprocesses of
        its own (the KWOK harness): reaping could steal their exit status."""
        self.reap_orphans = reap_orphans
        self.roles = roles
        self.redis_pid = redis_pid
        self.marker = marker.encode()
        # Workers run in sessions of their own (LocalStack starts them so).
        self.sampler = Sampler(marker, {os.getsid(p) for r in roles.values() for p in r})
        self._start: dict[str, float] = {}
        self._supervisor_own: dict[int, float] = {}

    def _role_totals(self, procs: dict[int, Proc]) -> dict[str, float]:
        totals = {}
        for role, roots in self.roles.items():
            pids = descendants(procs, roots)
            totals[role] = sum(procs[p].own + procs[p].children for p in pids)
        if self.redis_pid is not None and self.redis_pid in procs:
            totals["redis"] = procs[self.redis_pid].own
        return totals

    def _live_supervisors(self, procs: dict[int, Proc]) -> list[Proc]:
        return [
            p
            for p in procs.values()
            if p.state != "Z" and is_supervisor(p.argv) and any(self.marker in a for a in p.argv)
        ]

    def start(self) -> Meter:
        self.reap()  # leftovers of earlier windows are not this window's
        procs = snapshot()
        running = self._live_supervisors(procs)
        assert not running, f"supervisors from before the window still run: {running}"
        self._start = self._role_totals(procs)
        self._self0 = os.times()
        self.sampler.start()
        return self

    def stop(self, supervisor_timeout: float = 60.0) -> tuple[Usage, SandboxEvidence]:
        """Wait until this window's supervisors have exited, then account and reap."""
        end = time.monotonic() + supervisor_timeout
        while True:
            procs = self.sampler.sample()
            # Exited means a zombie: an exiting process has lost its command line already
            # but not yet its final CPU figures.
            known = self.sampler.supervisors
            live = (
                self._live_supervisors(procs)
                + [procs[pid] for pid in known if procs.get(pid, ZOMBIE).state != "Z"]
                + [  # orphaned sandboxes still exiting
                    p
                    for p in procs.values()
                    if p.ppid == os.getpid() and p.comm == "bwrap" and p.state != "Z"
                ]
            )
            if not live:
                break
            assert time.monotonic() < end, f"supervisors still running: {live}"
            time.sleep(0.05)
        evidence = self.sampler.stop()
        procs = snapshot()
        totals = self._role_totals(procs)
        # A zombie still shows its own CPU (not its children's): the supervisor's own share.
        own = {pid: procs[pid].own for pid in self.sampler.supervisors if pid in procs}
        reaped = self.reap()
        self_now = os.times()
        usage = Usage(
            control=totals.get("control", 0.0) - self._start.get("control", 0.0),
            collectors=totals.get("collectors", 0.0) - self._start.get("collectors", 0.0),
            redis=totals.get("redis", 0.0) - self._start.get("redis", 0.0),
            trainer=(self_now.user + self_now.system)
            - (self._self0.user + self._self0.system)
            - self.sampler.cpu_seconds,
        )
        for pid, (comm, total) in reaped.items():
            if pid in own:  # a supervisor: its own CPU, and the outer bwraps it reaped
                usage.supervisors += min(own[pid], total)
                usage.sandboxes += total - min(own[pid], total)
            elif comm == "bwrap":  # an orphaned sandbox: bwrap and the episode in it
                usage.sandboxes += total
            else:  # the supervisor's short-lived daemonizing fork
                usage.supervisors += total
        mine = {pid for pid, ppid in self.sampler.supervisors.items() if ppid == os.getpid()}
        missing = mine - set(reaped)
        assert not missing, f"supervisors not re-parented to this process (lost CPU): {missing}"
        return usage, evidence

    def reap(self) -> dict[int, tuple[str, float]]:
        """wait4 every zombie child of ours that is not a Popen of ours, i.e. what was
        re-parented to this subreaper: supervisors, their daemonizing forks, and the inner
        bwrap of each sandbox (the outer bwrap exits without reaping it, so it is orphaned
        with the episode's CPU in it). pid -> (comm, CPU seconds of it and all it reaped)."""
        reaped: dict[int, tuple[str, float]] = {}
        if not self.reap_orphans:
            return reaped
        me, popen = os.getpid(), self._popen_pids()
        for proc in snapshot().values():
            if proc.ppid == me and proc.state == "Z" and proc.pid not in popen:
                with contextlib.suppress(ChildProcessError):
                    _, _, usage = os.wait4(proc.pid, 0)
                    reaped[proc.pid] = (proc.comm, usage.ru_utime + usage.ru_stime)
        return reaped

    def _popen_pids(self) -> set[int]:
        # Workers and redis are subprocess.Popen children: theirs to reap, never ours.
        pids = {p for roots in self.roles.values() for p in roots}
        if self.redis_pid is not None:
            pids.add(self.redis_pid)
        return pids


def machine_busy_seconds() -> float:
    """CPU-seconds this machine has been busy since boot, all cores (/proc/stat: every state but
    idle and iowait)."""
    fields = [int(v) for v in _read("/proc/stat").split(b"\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def settle(below: float = 0.5, window: float = 1.0, timeout: float = 60.0) -> float:
    """Wait until the machine used less than `below` cores over the last `window` seconds: the
    node's teardown of the previous batch's Pods (runc, CNI DEL, the kubelet) runs on after its
    API objects are gone, and a batch started meanwhile pays for it. Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        before = machine_busy_seconds()
        time.sleep(window)
        if (machine_busy_seconds() - before) / window < below:
            break
    return time.monotonic() - start

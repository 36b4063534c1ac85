"""The cost ledger: the sandbox's CPU and peak memory, and what the policy was asked."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time

from .errors import InfrastructureError

# Where the CPU and memory figures come from, set by the backend: "cgroup" (Kubernetes: the
# container's own cgroup holds every process of the sandbox), "proc" (a PID namespace of its
# own, the local bubblewrap sandbox: every process in /proc is the sandbox's). Unset: the
# runner's own process tree (a runner with no namespace of its own must not count the host's).
COST_SOURCE_ENV = "ROLLOUT_COST_SOURCE"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_ROOT = "/proc"


def _read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read(65536)
    except (OSError, UnicodeDecodeError):
        return None


def _keyed_numbers(text: str | None) -> dict:
    """`name value` lines (cpu.stat, cpuacct.stat) as {name: int}."""
    found: dict = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            found[parts[0]] = int(parts[1])
    return found


def _first_number(root: str, names: tuple) -> int | None:
    for name in names:
        text = _read_text(os.path.join(root, name))
        if text is not None and text.strip().isdigit():
            return int(text.strip())
    return None


def read_cgroup(root: str = CGROUP_ROOT, ticks: float | None = None) -> dict:
    """CPU and peak memory of the cgroup at `root`: cgroup v2 (cpu.stat, memory.peak), else
    v1 (cpuacct.usage and cpuacct.stat, memory.max_usage_in_bytes); None for what is not
    there."""
    cost: dict = {
        "cpu_seconds": None,
        "cpu_user_seconds": None,
        "cpu_system_seconds": None,
        "peak_memory_bytes": None,
        "cpu_source": "cgroup",
    }
    v2 = _keyed_numbers(_read_text(os.path.join(root, "cpu.stat")))
    if "usage_usec" in v2:
        cost["cpu_seconds"] = v2["usage_usec"] / 1e6
        if "user_usec" in v2 and "system_usec" in v2:
            cost["cpu_user_seconds"] = v2["user_usec"] / 1e6
            cost["cpu_system_seconds"] = v2["system_usec"] / 1e6
    else:
        for folder in ("cpuacct", "cpu,cpuacct", "cpu"):
            base = os.path.join(root, folder)
            usage = _first_number(base, ("cpuacct.usage",))  # nanoseconds
            split = _keyed_numbers(_read_text(os.path.join(base, "cpuacct.stat")))  # ticks
            if usage is None and not split:
                continue
            hz = ticks or os.sysconf("SC_CLK_TCK")
            if "user" in split and "system" in split:
                cost["cpu_user_seconds"] = split["user"] / hz
                cost["cpu_system_seconds"] = split["system"] / hz
            if usage is not None:
                cost["cpu_seconds"] = usage / 1e9
            elif cost["cpu_user_seconds"] is not None:
                cost["cpu_seconds"] = (split["user"] + split["system"]) / hz
            break
    cost["peak_memory_bytes"] = _first_number(
        root,
        ("memory.peak", "memory.max_usage_in_bytes", "memory/memory.max_usage_in_bytes"),
    )
    return cost


def read_proc(root: str = PROC_ROOT, scope: int | None = None, ticks: float | None = None) -> dict:
    """CPU and peak memory of the processes in `root` (every one, or `scope` and the processes
    below it), in one pass. A process's CPU is its utime + stime plus cutime + cstime: a child
    that was waited for is in its reaper's, so the live processes account for every process
    that ever ran below them (an orphan's time is in whoever reaped it: the runner, a
    subreaper, or the namespace's init). Peak memory is the largest VmHWM: the largest single
    process, not a sum. CPU fields None when `root` (or the scope's process) is unreadable."""
    cost: dict = {
        "cpu_seconds": None,
        "cpu_user_seconds": None,
        "cpu_system_seconds": None,
        "peak_memory_bytes": None,
        "cpu_source": "proc",
    }
    try:
        entries = os.listdir(root)
    except OSError:
        return cost
    stats: dict = {}  # pid -> (parent, user ticks, system ticks)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(root, entry, "stat"), "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            # After the command: state, ppid, ... utime (14), stime, cutime, cstime (17).
            stats[int(entry)] = (
                int(fields[1]),
                int(fields[11]) + int(fields[13]),
                int(fields[12]) + int(fields[14]),
            )
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not a process's stat
    if scope is None:
        chosen = list(stats)
    elif scope in stats:
        children: dict = {}
        for pid, (parent, _, _) in stats.items():
            children.setdefault(parent, []).append(pid)
        chosen, todo = [scope], [scope]
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in chosen:
                    chosen.append(child)
                    todo.append(child)
    else:
        chosen = []
    if not chosen:
        return cost
    hz = ticks or os.sysconf("SC_CLK_TCK")
    user = sum(stats[pid][1] for pid in chosen) / hz
    system = sum(stats[pid][2] for pid in chosen) / hz
    cost.update(cpu_seconds=user + system, cpu_user_seconds=user, cpu_system_seconds=system)
    peaks = []
    for pid in chosen:
        for line in (_read_text(os.path.join(root, str(pid), "status")) or "").splitlines():
            if line.startswith("VmHWM:"):
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    peaks.append(int(parts[1]) * 1024)  # kB
                break
    cost["peak_memory_bytes"] = max(peaks) if peaks else None
    return cost


def read_usage(
    source: str | None, cgroup_root: str = CGROUP_ROOT, proc_root: str = PROC_ROOT
) -> dict:
    """The sandbox's CPU and peak memory as `source` (ROLLOUT_COST_SOURCE) says to read them."""
    if source == "cgroup":
        cost = read_cgroup(cgroup_root)
        if cost["cpu_seconds"] is not None:
            return cost
    # Kubernetes without readable cgroup files: the container's PID namespace is its own too.
    everything = source in ("cgroup", "proc")
    cost = read_proc(proc_root, scope=None if everything else os.getpid())
    # Also the largest child the runner waited for (kilobytes on Linux): one that ended before
    # the reading has no VmHWM left to read. Still the largest single process, not a sum.
    peaks = [cost["peak_memory_bytes"] or 0]
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        with contextlib.suppress(OSError, ValueError):
            peaks.append(resource.getrusage(who).ru_maxrss * 1024)
    cost["peak_memory_bytes"] = max(peaks) or None
    return cost


def _count(usage: object, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return None
    return int(value)


class Ledger:
    """What the episode asked of its policy: turns (every completion asked for), tokens (the
    responses' `usage`; a stream's comes in its last chunk), seconds waited. Counted where the
    answers arrive: the built-in loop's client and the recording proxy's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.turns = 0
        self.with_usage = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.policy_seconds = 0.0
        self.retry_seconds = 0.0
        self.requests = 0

    def sent(self) -> None:
        """One request sent to the policy (every attempt): the host's policy socket counts
        the completions it answered, and more answers than requests were never recorded."""
        with self.lock:
            self.requests += 1

    def retried(self, seconds: float) -> None:
        """`seconds` spent on failed attempts on the policy (and the waits between them)."""
        with self.lock:
            self.retry_seconds += max(0.0, seconds)

    def turn(self, response: object, seconds: float) -> None:
        """One completion asked for: `response` the parsed answer (None when there is none),
        `seconds` the wall time spent waiting on it."""
        usage = response.get("usage") if isinstance(response, dict) else None
        prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
        with self.lock:
            self.turns += 1
            self.policy_seconds += max(0.0, seconds)
            if prompt is not None or completion is not None:
                self.with_usage += 1
                self.prompt_tokens += prompt or 0
                self.completion_tokens += completion or 0

    def measure(self) -> dict:
        """The `cost` object of a final event: one reading of the sandbox's CPU and memory,
        and the policy's figures so far."""
        began = time.thread_time()  # this thread's reading alone
        cost = read_usage(os.environ.get(COST_SOURCE_ENV))
        with self.lock:
            # Turns whose answers all lacked `usage`: their tokens are unknown, not zero.
            unknown = self.turns > 0 and self.with_usage == 0
            cost.update(
                policy_turns=self.turns,
                prompt_tokens=None if unknown else self.prompt_tokens,
                completion_tokens=None if unknown else self.completion_tokens,
                policy_seconds=self.policy_seconds,
                policy_retry_seconds=self.retry_seconds,
                policy_requests=self.requests,
            )
        cost["ledger_cpu_seconds"] = time.thread_time() - began
        return cost


# One episode per runner process: its one ledger.
LEDGER = Ledger()


def time_allowed(time_limit: float) -> float:
    """The agent's time: its limit plus what failed attempts on the policy took, up to one
    more limit. A policy endpoint that stalls is infrastructure; its stall must not eat the
    agent's time and come back as a reward."""
    return time_limit + min(LEDGER.retry_seconds, time_limit)


def check_time_limit(time_limit: float) -> None:
    """Called when the time limit stopped the agent: InfrastructureError when failed policy
    attempts took more than the extension covers (the agent had less than its time)."""
    lost = LEDGER.retry_seconds
    if lost > time_limit:
        raise InfrastructureError(
            f"failed attempts on the policy took {lost:.1f}s of the agent's time, more than "
            f"its time limit ({time_limit:g}s) allows for: the agent did not get its time"
        )

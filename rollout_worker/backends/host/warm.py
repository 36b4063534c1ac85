"""Warm sandboxes inside a sandbox host: a batch with `warm_pool: N` has its episodes handed to
bwrap sandboxes of its shape that the host started before it took them (local/pool.py's, started
by local/pool.start_waiting, handed over by local/warm_start.start_warm with warm.handover_line).

Per batch and host, from the moment the host takes an episode of the batch (its HostRun opens)
until nothing of the batch is left to take (queue.untaken), the batch is stopped, past its
deadline, or the host drains: at most min(warm_pool, parallelism, episodes left to take) waiting
sandboxes. Each one holds a free slot: the host's leases plus its waiting sandboxes never exceed
its slots (so its CPU and memory stay within the slots' accounting), and an episode of any batch
taken into a slot that a waiting sandbox holds first kills one of another batch (`evictions`).
A waiting sandbox runs one episode and is never reused; one that is killed or dies waiting is
reaped at once and its folder removed. Only the first attempt of an episode starts warm (a
retry starts cold, as its hand-over line would say attempt 0), and only batches whose tasks a
waiting sandbox can run (`cold_reason`).

The agent is the waiting sandboxes' parent (no pool process): a host killed outright takes them
with it (bwrap --die-with-parent), and its next start wipes its root as before."""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_wire.request import BatchSpec
from rollout_worker.backends.local.phases import two_sandboxes
from rollout_worker.backends.local.pool import Taken, start_waiting

WARM_DIR = "warm"  # a run folder's waiting (and handed) sandboxes' homes
# Waiting sandboxes of a batch that ended on their own before the host stops starting them (a
# program that cannot start would otherwise be restarted in a loop): its episodes start cold.
MAX_DIED = 3


def cold_reason(spec: BatchSpec, isolation: str) -> str | None:
    """Why the batch's episodes start cold on a host although it asks warm sandboxes (None:
    they may start warm). The local supervisor's rule (warm_start.take_warm) and more: a
    waiting sandbox has the host's root at /workspace, no task file mounted and no grader
    behind it."""
    if not spec.warm_pool:
        return "no warm_pool"
    if isolation != "bwrap":
        return "isolation none: only bwrap reports a waiting sandbox's exit code"
    if spec.tasks and spec.policy is None:
        return "tasks without a policy: a hand-over line carries a task only with a policy"
    for task in spec.tasks:
        if two_sandboxes(task):
            return f"task {task.get('id')!r} is graded apart (hidden tests, steps or an agent)"
        for field in ("env", "image", "workdir"):
            if task.get(field):
                return f"task {task.get('id')!r} has {field}: its sandbox is not a waiting one's"
    return None


def wanted(warm_pool: int, parallelism: int, untaken: int, waiting: int) -> int:
    """How many more sandboxes one batch wants waiting on this host (negative: that many too
    many): never more than its warm_pool, its parallelism (no more of its episodes can come at
    once) or its episodes that no host holds or ended."""
    return min(warm_pool, parallelism, max(0, untaken)) - waiting


def starts(
    slots: int, busy: int, waiting: Mapping[str, int], wants: Mapping[str, int]
) -> dict[str, int]:
    """How many waiting sandboxes to start per batch: only into slots no lease (`busy`, taken
    and not ended) and no waiting sandbox holds, one at a time round the batches (in order),
    none beyond what each wants."""
    room = slots - busy - sum(waiting.values())
    left = {batch: want for batch, want in wants.items() if want > 0}
    started = dict.fromkeys(left, 0)
    while room > 0 and left:
        for batch in list(left):
            if room <= 0:
                break
            started[batch] += 1
            room -= 1
            left[batch] -= 1
            if not left[batch]:
                del left[batch]
    return {batch: n for batch, n in started.items() if n}


def evictions(
    slots: int, busy: int, waiting: Mapping[str, int], using: str | None
) -> dict[str, int]:
    """The waiting sandboxes to kill, per batch, before an episode just taken starts: `busy`
    counts its lease; `using` is its batch when it takes one of that batch's waiting
    sandboxes (that one becomes its slot). Other batches' go first, the most waiting first."""
    left = dict(waiting)
    if using is not None and left.get(using, 0) > 0:
        left[using] -= 1
    excess = busy + sum(left.values()) - slots
    killed: dict[str, int] = {}
    order = sorted(left, key=lambda batch: (batch == using, -left[batch], batch))
    for batch in order:
        n = min(excess, left[batch])
        if n > 0:
            killed[batch] = n
            excess -= n
    return killed


@dataclass
class _Waiting:
    sandbox: Taken  # its descriptors are ours until it is handed out
    proc: subprocess.Popen[bytes]


class WarmSandboxes:
    """One batch's waiting sandboxes on this host, and the process of each one handed out
    (reaped when its episode ends)."""

    def __init__(
        self,
        folder: Path,
        run: Mapping[str, Any],
        program: Path,
        selector: selectors.BaseSelector,
        owner: object,
    ) -> None:
        self.folder = folder
        self.run = run
        self.program = program
        self.selector = selector
        self.owner = owner  # the HostRun: the agent hands it ("waiting", name) events
        self.waiting: dict[str, _Waiting] = {}
        self.handed: dict[int, subprocess.Popen[bytes]] = {}  # by pid
        self.as_root = os.geteuid() == 0
        self.died = 0
        self.broken: str | None = None  # why this host starts no more of them

    def __len__(self) -> int:
        return len(self.waiting)

    def start(self) -> None:
        """One more waiting sandbox (bwrap, the run's limits, the host's sandbox options)."""
        self.folder.mkdir(mode=0o755, exist_ok=True)
        name = f"warm-{secrets.token_hex(4)}"
        home = self.folder / name
        try:
            proc, status = start_waiting(
                home,
                python=self.run["python"],
                python_prefix=self.run["python_prefix"],
                program=self.program,
                limits=self.run["limits"],
                as_root=self.as_root,
                disable_userns=bool(self.run.get("disable_userns")),
            )
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            raise
        assert proc.stdin is not None and proc.stdout is not None
        # Descriptors of our own (as a pool's supervisor receives them): whoever runs the
        # episode closes them; the Popen keeps only the right to reap.
        sandbox = Taken(
            name=name,
            pid=proc.pid,
            created_at=time.time(),
            workspace=home / "ws",
            io=home / "io",
            stdin=os.dup(proc.stdin.fileno()),
            out=os.dup(proc.stdout.fileno()),
            status=status,
            pidfd=os.pidfd_open(proc.pid),
        )
        proc.stdin.close()
        proc.stdout.close()
        self.waiting[name] = _Waiting(sandbox, proc)
        self.selector.register(sandbox.pidfd, selectors.EVENT_READ, ("waiting", name, self.owner))

    def take(self) -> Taken | None:
        """The oldest waiting sandbox (the likeliest to be ready), for one episode only."""
        if not self.waiting:
            return None
        item = self.waiting.pop(next(iter(self.waiting)))
        self.selector.unregister(item.sandbox.pidfd)
        self.handed[item.sandbox.pid] = item.proc
        return item.sandbox

    def reap(self, sandbox: Taken) -> None:
        """A handed-out sandbox ended (its pidfd said so): reap it. Its descriptors are its
        episode's to close; its folder goes with the episode's files."""
        proc = self.handed.pop(sandbox.pid, None)
        if proc is not None:
            proc.wait()

    def gone(self, sandbox: Taken) -> None:
        """A handed-out sandbox that ended before it read its hand-over line (its episode
        starts cold): make sure it is dead, reap it, remove its folder."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sandbox.pid, signal.SIGKILL)
        self.reap(sandbox)
        shutil.rmtree(sandbox.workspace.parent, ignore_errors=True)

    def ended(self, name: str) -> None:
        """A waiting sandbox ended on its own (a crash, its limits): forget it."""
        self._drop(name, kill=False)
        self.died += 1
        if self.died >= MAX_DIED:
            self.give_up(f"{self.died} waiting sandboxes ended before their episode")

    def give_up(self, why: str) -> None:
        """Start no more (the batch's episodes start cold on this host from now on)."""
        if self.broken is None:
            self.broken = why
            print(f"batch {self.folder.parent.name}: no more waiting sandboxes: {why}", flush=True)

    def kill(self, count: int | None = None) -> None:
        """Kill `count` waiting sandboxes, the youngest first (None: all of them)."""
        names = list(self.waiting)[::-1]
        for name in names if count is None else names[: max(0, count)]:
            self._drop(name, kill=True)

    def _drop(self, name: str, *, kill: bool) -> None:
        item = self.waiting.pop(name)
        sandbox = item.sandbox
        self.selector.unregister(sandbox.pidfd)
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sandbox.pid, signal.SIGKILL)
        item.proc.wait()
        for fd in (sandbox.stdin, sandbox.out, sandbox.status, sandbox.pidfd):
            os.close(fd)
        shutil.rmtree(sandbox.workspace.parent, ignore_errors=True)

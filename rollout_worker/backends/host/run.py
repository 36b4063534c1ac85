"""One batch inside a sandbox host: the local supervisor's machinery, per taken episode.

A host agent (agent.py) makes one HostRun per batch it runs something of. The run folder
(`<root>/<batch>/`) is written from the run document the queue holds, with this machine's own
fields; each taken episode then goes through the supervisor's unchanged start, launch, finish
and retry, in a fresh sandbox. Its end goes to the queue (fenced on the episode's lease), not to
a status file: the status, the log and the logs of attempts run again. The episode's files are
gone before that (as the local supervisor removes them before it writes a status) and its logs
right after, so nothing of an ended episode stays on the host's disk."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import redis

from rollout_wire.request import is_batch_id
from rollout_worker.backends.base import MAX_LOG_BYTES
from rollout_worker.backends.host.queue import HostQueue, Lease
from rollout_worker.backends.host.warm import WARM_DIR, WarmSandboxes, cold_reason, wanted
from rollout_worker.backends.local.files import LOG_CUT_MARK, RunDir, write_json_atomic
from rollout_worker.backends.local.output import Running
from rollout_worker.backends.local.phases import AGENT_PHASE, GRADE_PHASE
from rollout_worker.backends.local.run_file import machine_fields, progress_fields
from rollout_worker.backends.local.sandbox import ImageRoot
from rollout_worker.backends.local.supervisor import Supervisor
from rollout_worker.backends.local.warm_start import start_warm

# A finish the queue did not take (Redis away) is tried again this often before it is given up
# (the lease then expires and the episode runs again elsewhere, as after a lost host).
FINISH_TRIES = 3
FINISH_PAUSE_SECONDS = 0.5
# Why a sandbox is killed when its lease is lost: nothing is recorded for it here (the queue
# refuses the write), another host runs the episode again.
LEASE_LOST = "LeaseLost"


class Machine:
    """What a host tells every run document it materialises: its own sandbox interpreter,
    node name, Redis, image roots and sandbox options."""

    def __init__(
        self,
        *,
        node: str,
        python: str,
        redis_url: str,
        rootfs_dir: Path,
        isolation: str = "bwrap",
        disable_userns: bool = False,
    ) -> None:
        self.node = node
        self.python = python
        self.redis_url = redis_url
        self.rootfs_dir = rootfs_dir
        self.isolation = isolation
        self.disable_userns = disable_userns

    def localise(self, run: dict[str, Any]) -> dict[str, Any]:
        """The run document as this machine runs it."""
        batch = run["batch_id"]
        ttl = int((run.get("progress") or {}).get("ttl") or 7 * 24 * 3600)
        fields = machine_fields(
            isolation=self.isolation,
            python=self.python,
            rootfs_dir=self.rootfs_dir,
            node=self.node,
        )
        local = {key: value for key, value in run.items() if key != "pool_dir"}
        return (
            local
            | fields
            | {
                "progress": progress_fields(batch, self.redis_url, ttl),
                "disable_userns": self.disable_userns and self.isolation == "bwrap",
            }
        )


class HostRun(Supervisor):
    """One batch's episodes taken by this host: its run folder and its running sandboxes."""

    def __init__(
        self,
        root: Path,
        doc: bytes,
        queue: HostQueue,
        machine: Machine,
        *,
        program_dir: Path,
        selector: selectors.DefaultSelector,
        ended: Callable[[Lease], None],
    ) -> None:
        run = orjson.loads(doc)
        batch = run.get("batch_id") if isinstance(run, dict) else None
        if not is_batch_id(batch):
            raise ValueError(f"run document with no valid batch id ({batch!r})")
        run_dir = RunDir(root / batch)
        shutil.rmtree(run_dir.path, ignore_errors=True)  # an earlier run of it, left idle
        run_dir.path.mkdir(parents=True)
        run_dir.path.chmod(0o755)  # the sandboxes' host user reads its program and tasks
        write_json_atomic(run_dir.run_file, machine.localise(run))
        run_dir.program.parent.mkdir()
        for name in os.listdir(program_dir):
            # Hard links: the bytecode keeps its mtime, so the sandboxes run it (not the source).
            os.link(program_dir / name, run_dir.program.parent / name)
        super().__init__(run_dir)
        self.selector.close()
        self.selector = selector  # the agent's: it follows every run's sandboxes
        self.batch: str = batch
        self.queue = queue
        self.ended = ended
        # The leases of this run's episodes on this host; an episode holds its lease (and its
        # slot) through its retries and its grading sandbox, until its end is sent.
        self.leases: dict[int, Lease] = {}
        self.lost: set[int] = set()
        # A new lease of an index whose earlier (lost) sandbox has not ended yet here: it
        # starts when that one's end is dropped, so an old end is never sent under a new
        # lease, nor does it take the new sandbox's files or slot with it.
        self.held: dict[int, Lease] = {}
        self.abandoned = False  # the host leaves: nothing more is recorded (leases expire)
        self.parallelism = self.count  # the leases bound it: each pending index holds one
        self.idle_since: float | None = time.monotonic()
        # Its waiting sandboxes here (host/warm.py), when it asks some and its tasks allow.
        self.warm: WarmSandboxes | None = None
        # Its episodes no host holds and none ended (queue.untaken), as the agent last read
        # it: at each take of one of them and each look.
        self.untaken = 0
        if cold_reason(self.spec, self.run["isolation"]) is None:
            self.warm = WarmSandboxes(
                self.dir.path / WARM_DIR, self.run, self.dir.program, selector, self
            )

    @property
    def idle(self) -> bool:
        return not self.leases and not self.held and not self.running and not self.pending

    def warm_wanted(self) -> int:
        """How many more sandboxes it wants waiting here (negative: that many too many)."""
        if self.warm is None:
            return 0
        if self.warm.broken or self.stopping or self.abandoned or time.time() >= self.run_deadline:
            return -len(self.warm)
        return wanted(self.spec.warm_pool, self.spec.parallelism, self.untaken, len(self.warm))

    def uses_warm(self, lease: Lease) -> bool:
        """Whether this taken episode starts in one of its waiting sandboxes (a first attempt
        with one waiting; begin() decides the same way through start())."""
        return (
            self.warm is not None
            and len(self.warm) > 0
            and lease.attempt == 0
            and lease.index not in self.leases
            and not self.stopping
        )

    def all_leases(self) -> list[Lease]:
        """Every lease this run holds here (the held ones are renewed too)."""
        return [*self.leases.values(), *self.held.values()]

    def begin(self, lease: Lease) -> None:
        """Run a taken episode in a fresh sandbox; attempts lost with earlier hosts count as
        its earlier attempts (its sandbox name and the retry budget follow them)."""
        index = lease.index
        self.idle_since = None
        earlier = self.leases.get(index)
        if earlier is not None:
            # The queue gave the index out again: this host's earlier lease of it is lost
            # (renewal may not have said so yet). The new one waits for that sandbox's end.
            stale = self.held.pop(index, None)
            if stale is not None:
                self.ended(stale)
            self.held[index] = lease
            self.lose(earlier)
            return
        self.leases[index] = lease
        try:
            self.retried[index] = self.queue.attempts(self.batch, index)
            self.start(index)
        except (OSError, ValueError, subprocess.SubprocessError, redis.RedisError) as exc:
            if self.proxy is not None:
                self.proxy.close(index)
            self.refuse_start(index, ValueError(str(exc)))

    def start(self, index: int, phase: str = AGENT_PHASE, since: float | None = None) -> None:
        """A first attempt's agent starts in a waiting sandbox when the run has one (the local
        supervisor's hand-over); anything else, or one that ended while it waited, cold."""
        if (
            phase == AGENT_PHASE
            and self.warm is not None
            and self.attempt(index) == 0
            and not self.stopping
            and (sandbox := self.warm.take()) is not None
        ):
            try:
                start_warm(self, index, sandbox)
            except BaseException:
                # Not handed over (its policy socket, its log): it goes, the episode's start
                # fails as a cold one's would (begin). Its stdin may be closed already.
                if not any(item.warm is sandbox for item in self.running.values()):
                    for fd in (sandbox.out, sandbox.status, sandbox.pidfd):
                        with contextlib.suppress(OSError):
                            os.close(fd)
                self.warm.gone(sandbox)
                raise
            if index not in self.pending:
                return
            self.pending.remove(index)  # start_warm gave it back: its sandbox had ended
            self.warm.gone(sandbox)
        super().start(index, phase, since)

    def finish(self, item: Running) -> None:
        if item.warm is not None and self.warm is not None:
            self.warm.reap(item.warm)  # it exited (its pidfd said so): no zombie stays
        super().finish(item)
        if item.warm is not None:
            # Retried (its next attempt starts cold): the supervisor's retry removes only a
            # cold sandbox's workspace.
            shutil.rmtree(item.warm.workspace.parent, ignore_errors=True)

    def dispatch(self, kind: str, item: Any) -> None:
        if kind == "waiting":
            if self.warm is not None and item in self.warm.waiting:
                self.warm.ended(item)
            return
        super().dispatch(kind, item)

    def kill_waiting(self) -> None:
        if self.warm is not None:
            self.warm.kill()

    def lose(self, lease: Lease) -> None:
        """The queue gave the episode to someone else (lease expired and reaped, run
        deleted): kill its sandbox; its end is not recorded here."""
        if self.held.get(lease.index) == lease:  # never started: only its slot to free
            del self.held[lease.index]
            self.ended(lease)
            return
        if self.leases.get(lease.index) != lease:
            return
        self.lost.add(lease.index)
        for item in list(self.running.values()):
            if item.index == lease.index:
                item.kill(LEASE_LOST)
        if lease.index in self.pending:  # waiting for its retry: ends here at once
            self.pending.remove(lease.index)
            self.write_status(lease.index, phase="Failed", reason=LEASE_LOST, exit_code=None)

    def image_root(self, index: int) -> ImageRoot | None:
        """The local supervisor's; but an image task whose image this host does not carry (one
        that joined after the batch's preflight) fails to start (StartError) rather than run
        on the host's own root."""
        root = super().image_root(index)
        task = self.task_of(index)
        if root is None and task.get("image") and not task.get("files"):
            raise ValueError(f"this sandbox host does not carry the task image {task['image']}")
        return root

    def retry(self, item: Running, code: int, finished_at: float) -> bool:
        """The supervisor's retry (exit 4), its attempt recorded in the queue too."""
        if not super().retry(item, code, finished_at):
            return False
        lease = self.leases.get(item.index)
        if lease is not None and item.index not in self.lost:
            try:
                self.queue.record_attempts(lease, self.retried[item.index])
            except redis.RedisError as exc:  # the retry runs; only a later host misses it
                print(f"episode {item.index}: attempt not recorded ({exc})", flush=True)
        return True

    def abandon(self) -> None:
        """The host stops before these episodes end: kill them, record nothing (their leases
        expire and the queue gives them to another host)."""
        self.abandoned = True
        self.stopping = True  # no retry, no grading sandbox
        self.kill_waiting()
        for lease in self.held.values():
            self.ended(lease)
        self.held.clear()
        for item in list(self.running.values()):
            item.kill("HostStopping")

    def write_status(self, index: int, **fields: Any) -> None:
        """Send the episode's end to the queue, then forget its files; frees its slot."""
        lease = self.leases.pop(index, None)
        if lease is None:
            return
        try:
            if index not in self.lost and not self.abandoned:
                self.send(lease, self.status_fields(index, **fields))
        finally:
            self.forget(index)
            self.lost.discard(index)
            self.retried.pop(index, None)
            if self.idle:
                self.idle_since = time.monotonic()
            self.ended(lease)
        waiting = self.held.pop(index, None)
        if waiting is not None:
            self.begin(waiting)

    def send(self, lease: Lease, status: dict[str, Any]) -> None:
        index = lease.index
        log = _read(self.dir.log(index), MAX_LOG_BYTES + len(LOG_CUT_MARK) + 16)
        records = {}
        for attempt, _ in enumerate(status.get("retried") or []):
            kept = _read(self.dir.attempt_log(index, attempt), MAX_LOG_BYTES)
            if kept:
                records[f"episode-{index}.attempt{attempt}.log"] = kept
        for tries_left in range(FINISH_TRIES - 1, -1, -1):
            try:
                if not self.queue.finish(lease, status, log, records):
                    print(f"episode {index}: lease lost, its end not recorded", flush=True)
                return
            except redis.RedisError as exc:
                if not tries_left:
                    print(f"episode {index}: end not recorded ({exc})", flush=True)
                    return
                time.sleep(FINISH_PAUSE_SECONDS)

    def forget(self, index: int) -> None:
        """Everything of episode `index` left on disk: its logs, attempts and files."""
        logs = self.dir.log(index).parent
        names = [f"{index}.log", f"{index}.err"]
        with contextlib.suppress(FileNotFoundError):
            names += [n for n in os.listdir(logs) if n.startswith(f"{index}.attempt")]
        for name in names:
            (logs / name).unlink(missing_ok=True)
        self.dir.attempts(index).unlink(missing_ok=True)
        self.dir.status(index).unlink(missing_ok=True)
        shutil.rmtree(self.dir.workspace(index), ignore_errors=True)
        for phase in (AGENT_PHASE, GRADE_PHASE):
            shutil.rmtree(self.state_dir(index, phase), ignore_errors=True)

    def close(self) -> None:
        """The host runs nothing of this batch any more: its waiting sandboxes and its folder
        go."""
        self.kill_waiting()
        if self.proxy is not None:
            self.proxy.close_all()
        shutil.rmtree(self.dir.path, ignore_errors=True)


def _read(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read(limit)
    except FileNotFoundError:
        return b""

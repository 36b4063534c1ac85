"""The sandbox host agent: a long-lived process (one per host Pod) that takes episodes from the
hosts' Redis list (queue.py) while it has a free slot and runs each in a fresh bubblewrap
sandbox through the local supervisor's machinery (run.py), any batch's, one after another.

`python -m rollout_worker.backends.host.agent --redis-url URL --name NAME --slots N --root DIR`
(also `rollout host`). A taker thread blocks on the list while a slot is free and wakes the loop
through an eventfd in its selector; the loop follows every sandbox (pidfds, output), renews all
its leases every RENEW_SECONDS and kills the sandbox of a lease it lost, kills a stopped batch's
sandboxes, enforces deadlines and disk limits, and heartbeats. SIGTERM: take nothing more, let
the running episodes end (up to a grace), then exit 0; what is still running then is killed and
recorded nowhere, so its lease expires and another host runs it (HostLost).

It loads no `kubernetes` module, and never reaps with waitpid(-1): each sandbox is waited for
by its own Popen (or pidfd), and an orphan is the Pod's init's to reap."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import queue as queues
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

from rollout_wire.redis_url import redis_client
from rollout_wire.urls import redacted
from rollout_worker.backends.host import queue as host_queue
from rollout_worker.backends.host.images import carried_images, image_workdir, write_workdirs
from rollout_worker.backends.host.manifests import quantity
from rollout_worker.backends.host.queue import HostQueue, Lease
from rollout_worker.backends.host.run import HostRun, Machine
from rollout_worker.backends.host.warm import evictions, starts
from rollout_worker.backends.local.run_file import program_sha, write_program
from rollout_worker.settings import Settings

LOOK_SECONDS = 1.0  # how often the agent reads its batches' flags (cancelled, deleted)
IDLE_KEEP_SECONDS = 5.0  # a batch's folder kept this long with nothing of it running
TAKE_WAIT_SECONDS = 1.0  # one blocking take; the taker sees a stop this often
DEFAULT_GRACE_SECONDS = 25.0  # under a Pod's default terminationGracePeriodSeconds (30)
PROGRAM_DIR = "_program"  # the episode program, linked into each run (no batch id has "_")


class Taker(threading.Thread):
    """Takes an episode while a slot is free; each lease goes to the loop's inbox."""

    def __init__(self, queue: HostQueue, host: str, slots: int) -> None:
        super().__init__(name="taker", daemon=True)
        self.queue = queue
        self.host = host
        self.free = threading.Semaphore(slots)
        self.inbox: queues.SimpleQueue[Lease] = queues.SimpleQueue()
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.stop = threading.Event()
        self.unsure = False  # a take failed: it may have moved an item it never leased
        self.renewer: Renewer | None = None  # renews what it takes from the moment it takes it
        # A batch that expects another episode program (a rolling update) is left to hosts
        # that run it: preflight checked one at submit, TAKE checks this host's.
        self.program_sha = program_sha()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.free.acquire(timeout=0.2):
                continue
            try:
                if self.unsure:
                    # Back to the list for any host what that take left on this host's
                    # taking list (only this thread moves items there while it runs).
                    self.queue.recover(self.host)
                    self.unsure = False
                lease = self.queue.take(self.host, TAKE_WAIT_SECONDS, self.program_sha)
            except redis.RedisError as exc:
                print(f"taker: {exc}", flush=True)
                lease = None
                self.unsure = True
                self.stop.wait(1.0)
            if lease is None:
                self.free.release()
                continue
            if self.renewer is not None:
                self.renewer.hold(lease)
            self.inbox.put(lease)
            os.eventfd_write(self.wake, 1)


class Renewer(threading.Thread):
    """Renews every lease the host holds and heartbeats, on its own thread and Redis client
    (short timeouts): a loop busy or stuck in a slow Redis call loses no lease. Leases it
    finds lost (or all of them, unable to renew for a lease's lifetime) go to the loop."""

    def __init__(self, queue: HostQueue, host: str, every: float, wake: int) -> None:
        super().__init__(name="renewer", daemon=True)
        self.queue = queue
        self.host = host
        self.every = every
        self.wake = wake  # the loop's eventfd
        self.lock = threading.Lock()
        self.held: set[Lease] = set()  # taken and not yet ended (in the inbox or running)
        self.gone: set[Lease] = set()  # of those, the ones told lost
        self.lost: queues.SimpleQueue[Lease] = queues.SimpleQueue()
        self.info: dict[str, Any] = {}  # the heartbeat, as the loop last published it
        self.stop = threading.Event()
        self.last_renewed = time.monotonic()

    def hold(self, lease: Lease) -> None:
        with self.lock:
            self.held.add(lease)

    def drop(self, lease: Lease) -> None:
        with self.lock:
            self.held.discard(lease)
            self.gone.discard(lease)

    def busy(self) -> int:
        """Slots the host's leases hold (taken and not ended, started or not)."""
        with self.lock:
            return len(self.held)

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.renew()

    def renew(self) -> None:
        with self.lock:
            leases = sorted(self.held - self.gone, key=lambda x: (x.batch, x.index, x.token))
        try:
            lost = self.queue.renew(self.host, leases)
            self.last_renewed = time.monotonic()
            if self.info:
                self.queue.heartbeat(self.host, self.info)
        except redis.RedisError as exc:
            print(f"renew: {exc}", flush=True)
            if time.monotonic() - self.last_renewed < self.queue.lease_seconds:
                return
            lost = leases
        if lost:
            with self.lock:
                self.gone.update(lease for lease in lost if lease in self.held)
            for lease in lost:
                self.lost.put(lease)
            os.eventfd_write(self.wake, 1)


class Agent:
    def __init__(
        self,
        client: redis.Redis,
        *,
        name: str,
        slots: int,
        root: Path,
        machine: Machine,
        grace: float = DEFAULT_GRACE_SECONDS,
        slot_size: dict[str, int] | None = None,
        lease_seconds: float = host_queue.LEASE_SECONDS,
        policy_egress: list[dict[str, Any]] | None = None,
        renew_client: redis.Redis | None = None,
    ) -> None:
        self.queue = HostQueue(client, lease_seconds)
        # The policy endpoints this host's NetworkPolicy lets it reach ([{cidr, port}]), in the
        # heartbeat: a batch whose endpoint is outside them is refused at submit. None: no
        # such list was given (no NetworkPolicy of ours in front of this host).
        self.policy_egress = policy_egress
        # What one slot holds (slot_memory_bytes, slot_storage_bytes), in the heartbeat: the
        # Celery side refuses a batch whose limits fit no host's slot.
        self.slot_size = dict(slot_size or {})
        self.name = name
        self.slots = slots
        self.root = root
        self.machine = machine
        self.grace = grace
        self.selector = selectors.DefaultSelector()
        self.runs: dict[str, HostRun] = {}
        self.taker = Taker(HostQueue(client, lease_seconds), name, slots)
        self.selector.register(self.taker.wake, selectors.EVENT_READ, None)
        self.draining_since: float | None = None
        # Without bwrap an image task would run on the host's own root: none told.
        self.images = carried_images(machine.rootfs_dir) if machine.isolation == "bwrap" else []
        # At least three renewals per lease: one lost call never loses an episode. Its own
        # client (main gives it short timeouts), so the loop's Redis calls never delay it.
        self.renewer = Renewer(
            HostQueue(renew_client or client, lease_seconds),
            name,
            min(host_queue.RENEW_SECONDS, lease_seconds / 3),
            self.taker.wake,
        )
        self.taker.renewer = self.renewer

    # -- lifetime --------------------------------------------------------------------------
    def prepare(self) -> None:
        """A clean root (an emptyDir outlives a restarted container), the program written
        once, and what a previous life of this host moved off the list put back."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        # The sandboxes' host user (uid 1000 when the agent is root) passes through to its
        # runs; an agent that is not root runs its sandboxes as itself, and may not own the root
        # (an emptyDir's mount point is root's).
        with contextlib.suppress(PermissionError):
            self.root.chmod(0o755)
        write_program(self.root / PROGRAM_DIR / "episode.py", self.machine.python)
        self.queue.recover(self.name)
        self.renewer.info = self.info()
        self.queue.heartbeat(self.name, self.renewer.info)

    def drain(self, *_: object) -> None:
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    def serve(self) -> int:
        self.prepare()
        self.taker.start()
        self.renewer.start()
        next_look = 0.0
        while True:
            now = time.monotonic()
            if self.draining_since is not None and self.drained(now):
                break
            if now >= next_look:
                self.look()
                next_look = now + LOOK_SECONDS
            self.lose_lost()
            self.take_in()
            for run in list(self.runs.values()):
                run.tick(time.time())
            self.warm_up()
            self.renewer.info = self.info()  # what the renewer's next heartbeat tells
            for key, _ in self.selector.select(self.timeout(next_look)):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self.taker.wake)
                    continue
                kind, item, run = key.data
                run.dispatch(kind, item)
        for run in list(self.runs.values()):
            run.close()
        self.runs.clear()
        self.taker.stop.set()
        self.taker.join(TAKE_WAIT_SECONDS + 1)
        self.renewer.stop.set()
        self.renewer.join(TAKE_WAIT_SECONDS + 1)  # no heartbeat after the host leaves
        with contextlib.suppress(redis.RedisError):
            # What the taker moved off the list but never took goes back for other hosts.
            self.queue.recover(self.name)
            self.queue.leave(self.name)
        return 0

    def drained(self, now: float) -> bool:
        """Draining: True once nothing runs (past the grace, what runs is abandoned)."""
        assert self.draining_since is not None
        self.taker.stop.set()
        for run in self.runs.values():
            run.kill_waiting()  # no more episodes come here: their slots are nobody's
        if self.taker.is_alive() and now - self.draining_since < self.grace:
            return False  # a take under way may still bring an episode: it runs
        if now - self.draining_since >= self.grace:
            self.taker.stop.set()
            for run in self.runs.values():
                run.abandon()
        return self.taker.inbox.empty() and not any(run.all_leases() for run in self.runs.values())

    def timeout(self, next_look: float) -> float:
        deadlines = [
            deadline
            for run in self.runs.values()
            if run.leases
            for deadline in (run.run_deadline, *(r.deadline for r in run.running.values()))
        ]
        wall = min(deadlines, default=float("inf")) - time.time()
        return max(0.0, min(next_look - time.monotonic(), wall, LOOK_SECONDS))

    # -- episodes ----------------------------------------------------------------------------
    def take_in(self) -> None:
        """Start what the taker brought, each in a fresh sandbox of its batch's run."""
        while True:
            try:
                lease = self.taker.inbox.get_nowait()
            except queues.Empty:
                return
            if lease in self.renewer.gone:  # lost before it started: only its slot to free
                self.ended(lease)
                continue
            run = self.runs.get(lease.batch) or self.open_run(lease)
            if run is not None:
                self.make_room(run, lease)
                run.begin(lease)
                if run.warm is not None:
                    with contextlib.suppress(redis.RedisError):
                        run.untaken = self.queue.untaken(lease.batch)

    # -- warm sandboxes (host/warm.py) --------------------------------------------------------
    def waiting(self) -> dict[str, int]:
        return {b: len(run.warm) for b, run in self.runs.items() if run.warm is not None}

    def make_room(self, run: HostRun, lease: Lease) -> None:
        """Before a taken episode starts: kill the waiting sandboxes that would hold its slot
        (none when it takes one of its batch's own)."""
        using = lease.batch if run.uses_warm(lease) else None
        for batch, count in evictions(
            self.slots, self.renewer.busy(), self.waiting(), using
        ).items():
            warm = self.runs[batch].warm
            if warm is not None:
                warm.kill(count)

    def warm_up(self) -> None:
        """Each warm batch's waiting sandboxes to what it wants, in the slots no lease and no
        waiting sandbox holds; what a batch no longer wants (stopped, past its deadline,
        nothing left to take) killed."""
        if self.draining_since is not None:
            return
        wants: dict[str, int] = {}
        for batch, run in self.runs.items():
            want = run.warm_wanted()
            if want < 0 and run.warm is not None:
                run.warm.kill(-want)
            elif want > 0:
                wants[batch] = want
        if not wants:
            return
        for batch, count in starts(self.slots, self.renewer.busy(), self.waiting(), wants).items():
            warm = self.runs[batch].warm
            assert warm is not None  # only warm runs want some
            try:
                for _ in range(count):
                    warm.start()
            except (OSError, subprocess.SubprocessError, KeyError) as exc:
                warm.give_up(repr(exc))

    def open_run(self, lease: Lease) -> HostRun | None:
        try:
            doc = self.queue.run_doc(lease.batch)
            if doc is None:  # deleted since it was taken: nothing to run or record
                self.ended(lease)
                return None
            run = HostRun(
                self.root,
                doc,
                self.queue,
                self.machine,
                program_dir=self.root / PROGRAM_DIR,
                selector=self.selector,
                ended=self.ended,
            )
        except (OSError, ValueError, KeyError, TypeError, redis.RedisError) as exc:
            # Its lease expires: the queue runs it elsewhere or ends it (HostLost).
            print(f"batch {lease.batch}: cannot run it here: {exc!r}", flush=True)
            self.ended(lease)
            return None
        self.runs[lease.batch] = run
        return run

    def ended(self, lease: Lease) -> None:
        self.renewer.drop(lease)
        self.taker.free.release()

    def lose_lost(self) -> None:
        """Kill the sandboxes of the leases the renewer found lost."""
        while True:
            try:
                lease = self.renewer.lost.get_nowait()
            except queues.Empty:
                return
            run = self.runs.get(lease.batch)
            if run is not None:
                run.lose(lease)  # a lease it no longer holds is ignored there

    def look(self) -> None:
        """Kill a cancelled or deleted batch's sandboxes; drop the folders of idle runs."""
        for batch, run in list(self.runs.items()):
            try:
                stopped = self.queue.stopped(batch)
            except redis.RedisError:
                continue
            if stopped and run.leases:
                run.stopping = True  # its next tick kills with Stopped, as a local cancel
            if stopped:
                run.kill_waiting()
            elif run.warm is not None:
                with contextlib.suppress(redis.RedisError):
                    run.untaken = self.queue.untaken(batch)
            idle_for = time.monotonic() - (run.idle_since or time.monotonic())
            # A run whose sandboxes wait for its next episodes stays (they go when it has
            # nothing left to take, is stopped or past its deadline: warm_up).
            waits = run.warm is not None and len(run.warm) > 0
            if run.idle and (stopped or (idle_for >= IDLE_KEEP_SECONDS and not waits)):
                run.close()
                del self.runs[batch]

    def info(self) -> dict[str, Any]:
        held = sum(len(run.all_leases()) for run in self.runs.values())
        return {
            "slots": self.slots,
            "free": self.slots - held,
            "waiting": sum(self.waiting().values()),  # warm sandboxes, in free slots
            "batches": sorted(batch for batch, run in self.runs.items() if run.all_leases()),
            "program_sha": program_sha(),
            "images": self.images,
            "draining": self.draining_since is not None,
            **self.slot_size,
            **({} if self.policy_egress is None else {"policy_egress": self.policy_egress}),
        }


def bwrap_problem(*extra: str) -> str | None:
    """None when bubblewrap builds a sandbox here with `extra` options, run as the sandboxes
    run (uid 1000 when the agent is root), else why not."""
    root = os.geteuid() == 0
    argv = ["bwrap", "--unshare-all", *extra, "--ro-bind", "/", "/", "--uid", "1000", "true"]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=10,
            user=1000 if root else None,
            group=1000 if root else None,
            extra_groups=[] if root else None,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap failed to run: {exc}"
    return None if done.returncode == 0 else f"bwrap cannot build a sandbox: {done.stderr.strip()}"


def _size(text: str) -> int:
    """A size in bytes, given as bytes or a Kubernetes quantity (128Mi, 1Gi, 500M)."""
    try:
        size = int(quantity(text.strip()))
    except (ArithmeticError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from exc
    if size <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return size


def _egress(text: str) -> list[dict[str, Any]]:
    """`CIDR:PORT[,CIDR:PORT...]` (maybe empty: no policy endpoint) as [{cidr, port}]."""
    endpoints = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        cidr, _, port = part.rpartition(":")  # an IPv6 CIDR has colons of its own
        try:
            network = ipaddress.ip_network(cidr, strict=False)
            number = int(port)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not CIDR:PORT: {part!r}") from exc
        if not 0 < number < 65536:
            raise argparse.ArgumentTypeError(f"not a port: {part!r}")
        endpoints.append({"cidr": str(network), "port": number})
    return endpoints


def parse(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("ROLLOUT_REDIS_URL"))
    parser.add_argument("--name", default=os.environ.get("HOSTNAME") or socket.gethostname())
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--root", type=Path, default=Path("/var/lib/rollout-host"))
    parser.add_argument(
        "--python",
        default=os.environ.get("ROLLOUT_LOCAL_PYTHON") or Settings().local_python,
        help="the sandboxes' interpreter (default: as the local backend's)",
    )
    parser.add_argument("--rootfs", type=Path, default=Path("/rootfs"), help="image roots")
    parser.add_argument(
        "--image-workdir",
        type=image_workdir,
        action="append",
        default=[],
        metavar="IMAGE=WORKDIR",
        help="a task image whose root is mounted (not exported) at --rootfs/<its folder>: its "
        "WORKDIR, written beside it at start (repeat per image)",
    )
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS)
    for what in ("memory", "storage"):
        parser.add_argument(
            f"--slot-{what}",
            type=_size,
            default=None,
            help=f"one slot's {what} (bytes or a quantity: 128Mi), told in the heartbeat so "
            f"that a batch whose {what} limit is larger is refused at submit",
        )
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=host_queue.LEASE_SECONDS,
        help="how long a silent host keeps its episodes (at least 1; default: %(default)s); "
        "shorter reruns a lost host's episodes sooner, at the cost of more renewals",
    )
    parser.add_argument(
        "--policy-egress",
        type=_egress,
        default=None,
        help="CIDR:PORT,... the policy endpoints this host may reach (its NetworkPolicy's), "
        "told in the heartbeat so that a batch whose policy is elsewhere is refused at submit; "
        "empty: none. Not given: the host claims no limit",
    )
    parser.add_argument(
        "--isolation",
        choices=("bwrap", "none"),
        default="bwrap",
        help="none: no sandbox at all, for tests on machines without user namespaces",
    )
    args = parser.parse_args(argv)
    if not args.redis_url:
        parser.error("--redis-url (or ROLLOUT_REDIS_URL) is needed")
    if args.slots < 1:
        parser.error("--slots must be at least 1")
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    if args.isolation == "bwrap" and (problem := bwrap_problem()):
        print(f"rollout host: sandboxes need bubblewrap, but {problem}", file=sys.stderr)
        return 2
    try:
        missing = write_workdirs(args.rootfs, args.image_workdir)
    except OSError as exc:
        print(f"rollout host: cannot write the images' WORKDIRs: {exc}", file=sys.stderr)
        return 2
    for image in missing:
        # On Kubernetes: an API server or kubelet without the ImageVolume gate drops the volume.
        print(f"rollout host: task image {image} has no root under {args.rootfs}", flush=True)
    client = redis_client(args.redis_url, socket_timeout=10, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        print(f"rollout host: Redis {redacted(args.redis_url)} unreachable: {exc}", file=sys.stderr)
        return 2
    machine = Machine(
        node=args.name,
        python=args.python,
        redis_url=args.redis_url,
        rootfs_dir=args.rootfs,
        isolation=args.isolation,
        # --disable-userns: bubblewrap 0.8.0 and later.
        disable_userns=args.isolation == "bwrap"
        and bwrap_problem("--unshare-user", "--disable-userns") is None,
    )
    lease_seconds = max(1.0, args.lease_seconds)
    # Renewal's calls give up well within a lease: a slow Redis call is retried at the next
    # renewal instead of outliving the lease (the loop's client keeps its 10 s).
    timeout = max(0.5, min(2.0, lease_seconds / 4))
    sizes = {"slot_memory_bytes": args.slot_memory, "slot_storage_bytes": args.slot_storage}
    agent = Agent(
        client,
        name=args.name,
        slots=args.slots,
        root=args.root,
        machine=machine,
        grace=args.grace,
        slot_size={field: size for field, size in sizes.items() if size is not None},
        lease_seconds=lease_seconds,
        policy_egress=args.policy_egress,
        renew_client=redis_client(
            args.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout
        ),
    )
    signal.signal(signal.SIGTERM, agent.drain)
    signal.signal(signal.SIGINT, agent.drain)
    print(
        f"rollout host {args.name}: {args.slots} slots, root {args.root}, "
        f"isolation {args.isolation}, user namespaces inside: "
        f"{'forbidden' if machine.disable_userns else 'allowed'}",
        flush=True,
    )
    return agent.serve()


if __name__ == "__main__":
    sys.exit(main())

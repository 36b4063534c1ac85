"""Warm sandboxes on this machine: one long-lived pool process per sandbox shape holds sandboxes
that already run the episode program up to the point where it needs its episode, and hands
them to runs' supervisors.

The pool process (`python -m rollout_worker.backends.local.pool --daemonize POOL_DIR`) starts
each sandbox exactly as a supervisor starts a cold one (sandbox.plan_sandbox: bwrap, no
network, uid 1000, no capabilities, the same resource limits), plus `ROLLOUT_HANDOVER=stdin`, a
folder of its own at /sandbox/io (where the supervisor later puts the episode's policy socket)
and bwrap's `--json-status-fd` (the exit code, for a supervisor that is not the sandbox's
parent). A supervisor connects to the pool's SOCK_SEQPACKET socket and asks for n sandboxes;
each comes back as one message with its stdin, stdout, status pipe and pidfd (SCM_RIGHTS). The
pool keeps only the right to reap it and never hands a sandbox out twice; it starts replacements
when asked to fill (behind a batch) and for each sandbox a running batch takes (so each freed
slot of that batch finds a waiting sandbox again).
The pool stops its waiting sandboxes and exits when drained or idle (no request for its idle
time), once no sandbox it handed out still runs.

Only with bwrap isolation: without bwrap, the exit code of a process that is not one's child
cannot be read.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rollout_worker.backends.local.files import daemonize, unix_address, write_json_atomic
from rollout_worker.backends.local.sandbox import Mount, plan_sandbox, rlimits

IO_MOUNT = "/sandbox/io"
POLICY_SOCKET = f"{IO_MOUNT}/policy.sock"
REQUEST_BYTES = 4096


class PoolDir:
    """A pool's folder: pool.json (its shape, size, limits), the socket, its sandboxes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    config = property(lambda self: self.path / "pool.json")
    state = property(lambda self: self.path / "state.json")  # {"waiting": n, "handed": m}
    socket = property(lambda self: self.path / "pool.sock")
    lock = property(lambda self: self.path / "pool.lock")
    pid = property(lambda self: self.path / "pool.pid")
    log = property(lambda self: self.path / "pool.log")
    program = property(lambda self: self.path / "episode.py")

    def sandbox(self, name: str) -> Path:
        return self.path / "sandboxes" / name

    def read(self, path: Path) -> dict[str, Any] | None:
        try:
            value = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def alive(self) -> bool:
        """Whether a pool process holds this pool (its lock)."""
        try:
            with open(self.lock, "a+") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False


@dataclass
class Taken:
    """A warm sandbox as a supervisor receives it (it owns these descriptors now)."""

    name: str
    pid: int
    created_at: float
    workspace: Path
    io: Path
    stdin: int
    out: int
    status: int
    pidfd: int


def take(
    pool_dir: PoolDir, count: int, timeout: float = 2.0, *, refill: bool = False
) -> list[Taken]:
    """Up to `count` waiting sandboxes from the pool (none when it does not answer). With
    `refill`, the pool starts a replacement for each right after (a batch's pipeline)."""
    if count <= 0 or not pool_dir.socket.exists():
        return []
    taken: list[Taken] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        try:
            with unix_address(pool_dir.socket) as address:
                sock.connect(address)
            sock.send(orjson.dumps({"take": count, "refill": refill}))
            while True:
                data, fds, _flags, _addr = socket.recv_fds(sock, REQUEST_BYTES, 4)
                header: dict[str, Any] = orjson.loads(data) if data else {"done": True}
                if header.get("done") or len(fds) != 4:
                    for fd in fds:
                        os.close(fd)
                    break
                taken.append(
                    Taken(
                        name=header["name"],
                        pid=header["pid"],
                        created_at=header["created_at"],
                        workspace=Path(header["workspace"]),
                        io=Path(header["io"]),
                        stdin=fds[0],
                        out=fds[1],
                        status=fds[2],
                        pidfd=fds[3],
                    )
                )
        except (OSError, orjson.JSONDecodeError):
            pass  # a pool that stopped or broke: what came is ours, the rest runs cold
    return taken


def ask(pool_dir: PoolDir, request: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    """Send a control request (fill, drain, status) to a running pool."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout)
        with unix_address(pool_dir.socket) as address:
            sock.connect(address)
        sock.send(orjson.dumps(request))
        answer = orjson.loads(sock.recv(REQUEST_BYTES))
    return answer if isinstance(answer, dict) else {}


def exit_code(status_fd: int) -> int | None:
    """The sandbox's exit code from bwrap's JSON status (read to EOF; None if bwrap wrote
    none: it was killed itself)."""
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(status_fd, 65536):
            data += chunk
    code = None
    for part in data.replace(b"}{", b"}\n{").splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(part)
            if isinstance(doc, dict) and "exit-code" in doc:
                code = int(doc["exit-code"])
    return code


def start_waiting(
    home: Path,
    *,
    python: str,
    python_prefix: str,
    program: Path,
    limits: Mapping[str, Any],
    as_root: bool,
    disable_userns: bool = False,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start one waiting sandbox in `home` (its workspace `ws`, its `io` folder, its `stderr`)
    exactly as a cold one starts (bwrap, the same limits), waiting for its hand-over line on
    stdin. Returns the process (stdin and stdout are pipes) and the read end of bwrap's status
    pipe. Also a sandbox host's (host/warm.py), with `disable_userns` as its cold sandboxes."""
    workspace, io = home / "ws", home / "io"
    workspace.mkdir(parents=True)
    io.mkdir()
    home.chmod(0o755)
    io.chmod(0o755)
    read_end, write_end = os.pipe()
    plan = plan_sandbox(
        isolation="bwrap",
        python=python,
        python_prefix=python_prefix,
        program=program,
        workspace=workspace,
        episode_id=home.name,
        action="",
        running_as_root=as_root,
        extra_env={"ROLLOUT_HANDOVER": "stdin"},
        mounts=[Mount(io, IO_MOUNT, "ROLLOUT_IO_DIR")],
        status_fd=write_end,
        disable_userns=disable_userns,
    )
    if plan.run_as:
        os.chown(workspace, *plan.run_as)
    try:
        with open(home / "stderr", "wb") as err:
            proc = subprocess.Popen(
                plan.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=plan.cwd,
                env=plan.env,
                pass_fds=(write_end,),
                start_new_session=True,
                preexec_fn=rlimits(
                    limits["memory_bytes"], limits["cpu_seconds"], limits.get("storage_bytes")
                ),
                user=plan.run_as[0] if plan.run_as else None,
                group=plan.run_as[1] if plan.run_as else None,
                extra_groups=[] if plan.run_as else None,
            )
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return proc, read_end


@dataclass
class _Waiting:
    name: str
    proc: subprocess.Popen[bytes]
    status: int  # read end of bwrap's status pipe
    pidfd: int
    created_at: float


class PoolProcess:
    def __init__(self, pool_dir: PoolDir) -> None:
        self.dir = pool_dir
        config = pool_dir.read(pool_dir.config)
        if config is None:
            raise SystemExit(f"no pool.json in {pool_dir.path}")
        self.config = config
        self.waiting: dict[str, _Waiting] = {}
        self.handed: dict[int, subprocess.Popen[bytes]] = {}  # pidfd -> sandbox to reap
        self.selector = selectors.DefaultSelector()
        self.last_used = time.time()
        self.stopping = False
        self.as_root = os.geteuid() == 0

    def reload(self) -> None:
        self.config = self.dir.read(self.dir.config) or self.config

    def start_one(self) -> None:
        name = f"warm-{secrets.token_hex(4)}"
        c = self.config
        proc, status = start_waiting(
            self.dir.sandbox(name),
            python=c["python"],
            python_prefix=c["python_prefix"],
            program=self.dir.program,
            limits=c["limits"],
            as_root=self.as_root,
        )
        pidfd = os.pidfd_open(proc.pid)
        self.waiting[name] = _Waiting(name, proc, status, pidfd, time.time())
        self.selector.register(pidfd, selectors.EVENT_READ, ("waiting", name))

    def refill(self) -> None:
        while not self.stopping and len(self.waiting) < int(self.config["size"]):
            self.start_one()
        self.write_state()

    def write_state(self) -> None:
        write_json_atomic(
            self.dir.state, {"waiting": len(self.waiting), "handed": len(self.handed)}
        )

    def give(self, conn: socket.socket, count: int) -> None:
        for name in list(self.waiting)[:count]:
            item = self.waiting.pop(name)
            self.selector.unregister(item.pidfd)
            assert item.proc.stdin is not None and item.proc.stdout is not None
            home = self.dir.sandbox(name)
            header = {
                "name": name,
                "pid": item.proc.pid,
                "created_at": item.created_at,
                "workspace": str(home / "ws"),
                "io": str(home / "io"),
            }
            fds = [item.proc.stdin.fileno(), item.proc.stdout.fileno(), item.status, item.pidfd]
            try:
                socket.send_fds(conn, [orjson.dumps(header)], fds)
            finally:
                # Handed out or not, it never waits here again: a sandbox runs one episode.
                item.proc.stdin.close()
                item.proc.stdout.close()
                os.close(item.status)
                self.handed[item.pidfd] = item.proc
                self.selector.register(item.pidfd, selectors.EVENT_READ, ("handed", None))
        with contextlib.suppress(OSError):
            conn.send(orjson.dumps({"done": True}))

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = orjson.loads(conn.recv(REQUEST_BYTES))
            except (OSError, orjson.JSONDecodeError):
                return
            self.last_used = time.time()
            if "take" in request:
                self.give(conn, int(request["take"]))
                if request.get("refill"):
                    self.refill()
            else:
                if request.get("drain"):
                    self.stopping = True
                elif request.get("fill"):
                    self.reload()
                self.refill()
                with contextlib.suppress(OSError):
                    conn.send(
                        orjson.dumps({"waiting": len(self.waiting), "handed": len(self.handed)})
                    )
            self.write_state()

    def stop_waiting(self) -> None:
        for item in self.waiting.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(item.proc.pid, signal.SIGKILL)
            item.proc.wait()
            self.selector.unregister(item.pidfd)
            os.close(item.pidfd)
            os.close(item.status)
            shutil.rmtree(self.dir.sandbox(item.name), ignore_errors=True)
        self.waiting.clear()
        self.write_state()

    def loop(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            self.dir.socket.unlink()
        with unix_address(self.dir.socket) as address:
            server.bind(address)
        server.listen(64)
        self.selector.register(server, selectors.EVENT_READ, ("server", None))
        self.refill()
        idle = float(self.config["idle_seconds"])
        while not (self.stopping and not self.handed):
            if not self.stopping and time.time() - self.last_used > idle:
                self.stopping = True
            if self.stopping and self.waiting:
                self.stop_waiting()
                with contextlib.suppress(FileNotFoundError):
                    self.dir.socket.unlink()  # no new supervisor finds this pool
            for key, _ in self.selector.select(1.0):
                kind, name = key.data
                if kind == "server":
                    conn, _ = server.accept()
                    self.serve(conn)
                elif kind == "waiting":
                    # A waiting sandbox ended on its own (its lifetime, a crash): replace it.
                    item = self.waiting.pop(name)
                    self.selector.unregister(item.pidfd)
                    item.proc.wait()
                    os.close(item.pidfd)
                    os.close(item.status)
                    shutil.rmtree(self.dir.sandbox(name), ignore_errors=True)
                    self.refill()
                else:  # a handed-out sandbox ended: reap it (its supervisor read its status)
                    proc = self.handed.pop(key.fd)
                    self.selector.unregister(key.fd)
                    proc.wait()
                    os.close(key.fd)
                    self.write_state()
        server.close()
        with contextlib.suppress(FileNotFoundError):
            self.dir.socket.unlink()

    def request_stop(self, *_: object) -> None:
        self.stopping = True


def serve(path: Path) -> int:
    pool_dir = PoolDir(path)
    lock = open(pool_dir.lock, "a+")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another pool process holds this pool
    pool_dir.pid.write_text(str(os.getpid()))
    process = PoolProcess(pool_dir)
    signal.signal(signal.SIGTERM, process.request_stop)
    signal.signal(signal.SIGINT, process.request_stop)
    process.loop()
    shutil.rmtree(pool_dir.path / "sandboxes", ignore_errors=True)
    pool_dir.state.unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--daemonize", action="store_true")
    parser.add_argument("pool_dir", type=Path)
    args = parser.parse_args(argv)
    if args.daemonize and not daemonize(args.pool_dir / "pool.log"):
        return 0
    return serve(args.pool_dir)


if __name__ == "__main__":
    sys.exit(main())

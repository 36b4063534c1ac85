"""An all-in-one stack for one run or one test session: a private redis-server and workers.

Everything it starts lives in a temporary directory and is stopped on exit, so nothing is
left running. Workers are real `rollout worker` processes: one on `control`, N on `collect`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import redis

from rollout_wire import constants as k
from rollout_wire.errors import StackError

REDIS_START_SECONDS = 10.0
# What `aof=True` asks of redis-server: as docker-compose.yml and the Helm chart run it. A write
# is in the file (the page cache) before its reply; at most the last second of them is not yet
# fsynced to the disk.
REDIS_APPENDFSYNC = "everysec"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProc:
    name: str
    queue: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class LocalStack:
    collectors: int = 2
    collect_concurrency: int = 64
    control_concurrency: int = 2
    extra_env: dict[str, str] = field(default_factory=dict)
    keep_dir: bool = False
    # Redis as production runs it (docker-compose.yml, the Helm chart): an append-only file
    # fsynced once a second (`appendfsync everysec`, set explicitly, not left to the server's
    # default), and with a password and TLS (rediss://, a private CA made here): every client
    # then uses that URL.
    aof: bool = False
    # With `aof`: when Redis fsyncs its append-only file (always: before each reply).
    appendfsync: str = REDIS_APPENDFSYNC
    password: str | None = None
    tls: bool = False
    # Workers only, on a Redis someone else runs (a Sentinel set in tests): no redis-server.
    external_redis_url: str | None = None
    # The workers' working directory (`python -m` imports from it first): a benchmark runs
    # an older checkout's workers this way, beside today's.
    cwd: str | None = None
    # One more address redis-server listens on besides 127.0.0.1 (the workers keep using
    # that): the real node's address, so host Pods there reach the test's Redis
    # (`redis_url_at`). Without a password, protected mode is then off: anyone who reaches
    # that address reaches Redis.
    redis_bind: str | None = None

    def __post_init__(self) -> None:
        if self.collectors < 1:
            raise StackError("an all-in-one stack needs at least one collect worker")
        self.dir = Path(tempfile.mkdtemp(prefix="rollout-stack-"))
        self.dir.chmod(0o755)  # local runs live below: sandboxes run as another host user
        self.port = 0
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.workers: list[WorkerProc] = []

    @property
    def redis_url(self) -> str:
        if self.external_redis_url:
            return self.external_redis_url
        return self.redis_url_at("127.0.0.1")

    def redis_url_at(self, address: str) -> str:
        """The stack's Redis URL through `address` (127.0.0.1, or `redis_bind`)."""
        auth = f":{self.password}@" if self.password else ""
        host = f"[{address}]" if ":" in address else address
        if self.tls:
            ca = self.dir / "tls" / "ca.crt"
            return f"rediss://{auth}{host}:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
        return f"redis://{auth}{host}:{self.port}/0"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "ROLLOUT_REDIS_URL": self.redis_url,
            "ROLLOUT_LOCAL_ROOT": str(self.dir / "runs"),
            **self.extra_env,
        }

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LocalStack:
        try:
            if not self.external_redis_url:
                self.start_redis()
            self.start_worker(
                k.QUEUE_CONTROL, "control", pool="prefork", concurrency=self.control_concurrency
            )
            for n in range(self.collectors):
                self.start_worker(
                    k.QUEUE_COLLECT,
                    f"collect{n + 1}",
                    pool="threads",
                    concurrency=self.collect_concurrency,
                )
        except BaseException:
            self.stop()
            raise
        return self

    def start_redis(self) -> None:
        """Start redis-server on the stack's port and data directory (with `aof`, it loads the
        append-only file a previous server left there) and wait until it answers."""
        server = shutil.which("redis-server")
        if not server:
            raise StackError("redis-server is not installed (apt-get install redis-server)")
        self.port = self.port or free_port()
        bind = ["127.0.0.1", self.redis_bind] if self.redis_bind else ["127.0.0.1"]
        args = [server, "--bind", *bind, "--save", "", "--dir", str(self.dir)]
        args += ["--daemonize", "no", "--appendonly", "yes" if self.aof else "no"]
        if self.aof:
            args += ["--appendfsync", self.appendfsync]
        if self.password:
            args += ["--requirepass", self.password]
        elif self.redis_bind:
            # Protected mode answers only loopback clients of a server without a password; the
            # caller asked for this address (set `password` to keep others out).
            args += ["--protected-mode", "no"]
        if self.tls:
            tls = _make_tls(self.dir / "tls")
            args += ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(tls / "server.crt")]
            args += ["--tls-key-file", str(tls / "server.key")]
            args += ["--tls-ca-cert-file", str(tls / "ca.crt"), "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.redis_proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        client = redis.Redis.from_url(self.redis_url)
        end = time.monotonic() + REDIS_START_SECONDS
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError as exc:
                if self.redis_proc.poll() is not None or time.monotonic() > end:
                    raise StackError(
                        f"redis-server did not start: {exc}; see {self.dir / 'redis.log'}"
                    ) from exc
                time.sleep(0.05)
            finally:
                client.close()

    def stop_redis(self) -> None:
        """Stop redis-server the way an operator would (SIGTERM: it writes its AOF and exits)."""
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.redis_proc.kill()
                self.redis_proc.wait()

    def kill_redis(self) -> None:
        """Kill redis-server the way a crash or the OOM killer does (SIGKILL: no AOF rewrite, no
        final fsync, clients cut mid-reply), and return once the process is gone (reaped, its
        port closed). What it wrote to the append-only file stays on disk for `start_redis`."""
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.kill()
            self.redis_proc.wait()

    def restart_redis(self, down_seconds: float = 0.0, *, kill: bool = False) -> None:
        """Stop redis-server (SIGTERM, or SIGKILL with `kill`), wait `down_seconds`, start it
        again on the same port and data directory."""
        if kill:
            self.kill_redis()
        else:
            self.stop_redis()
        time.sleep(down_seconds)
        self.start_redis()

    def start_worker(self, queue: str, name: str, *, pool: str, concurrency: int) -> WorkerProc:
        log = self.dir / f"worker-{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "rollout_worker.cli",
            "worker",
            "--queues",
            queue,
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"{name}@%h",
            "--loglevel",
            "INFO",
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        worker = WorkerProc(name, queue, proc, log)
        self.workers.append(worker)
        return worker

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until every worker answers a ping (runs do not need this: tasks queue)."""
        from rollout_worker.celery_app import create_app
        from rollout_worker.settings import Settings

        app = create_app(Settings(redis_url=self.redis_url), with_tasks=False)
        expected = {f"{w.name}@{socket.gethostname()}" for w in self.workers}
        end = time.monotonic() + timeout
        try:
            while True:
                self.check_alive()
                replies = app.control.ping(timeout=1.0) or []
                if expected <= {name for reply in replies for name in reply}:
                    return
                if time.monotonic() > end:
                    raise StackError(f"workers not ready after {timeout:.0f}s: {sorted(expected)}")
        finally:
            app.close()

    def check_alive(self) -> None:
        """Raise StackError with the log tail of any process that died."""
        for worker in self.workers:
            if worker.proc.poll() is not None:
                tail = worker.log.read_text(errors="replace")[-2000:]
                raise StackError(
                    f"worker {worker.name} exited with {worker.proc.returncode}:\n{tail}"
                )
        if self.redis_proc is not None and self.redis_proc.poll() is not None:
            raise StackError("the stack's redis-server exited")

    def stop_worker(
        self, worker: WorkerProc, sig: int = signal.SIGTERM, wait: float = 20.0
    ) -> None:
        if worker.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.proc.pid, sig)
            try:
                worker.proc.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()

    def pool_children(self, worker: WorkerProc) -> list[int]:
        """Pids of a worker's direct children (a prefork worker's pool processes), for fault
        tests that kill one of them. Empty when the worker is gone."""
        pids: list[int] = []
        for children in Path(f"/proc/{worker.proc.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids += [int(pid) for pid in children.read_text().split()]
        return sorted(set(pids))

    def stop(self) -> None:
        self._stop_supervisors()
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.proc.pid, signal.SIGTERM)  # warm shutdown, all at once
        for worker in self.workers:
            self.stop_worker(worker)
        self.stop_redis()
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_supervisors(self) -> None:
        """Local runs still going (a run abandoned by its caller) end with the stack."""
        for pid_file in (self.dir / "runs").glob("*/supervisor.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _make_tls(directory: Path) -> Path:
    """A private CA and a server certificate for 127.0.0.1 (openssl), made once per stack."""
    if (directory / "server.crt").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=rollout-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    )
    return directory

"""Redis without a single point of failure: a primary, a replica and three Sentinels on this
machine, workers and the trainer on a sentinel:// URL, and the primary killed mid-batch.

Everything is a real process: two redis-servers, three `redis-server --sentinel`, a control
worker and a collector (`python -m rollout_worker.cli worker`), the local backend's supervisor
and sandboxes. Every wait is bounded.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from rollout_wire import constants as k
from rollout_wire.redis_url import master_address
from rollout_worker.cli.stack import LocalStack, free_port
from trainer_stub.client import RolloutClient

pytestmark = [pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]

MASTER = "rollout"
START_SECONDS = 30.0  # servers up, replica in sync, Sentinels know each other
FAILOVER_SECONDS = 30.0  # down-after 1 s, then election and promotion
REPORT_SECONDS = 240.0
COUNT, PARALLELISM = 40, 4
ROWS_BEFORE_KILL = 8


def wait_for(what: str, check, timeout: float, interval: float = 0.1):
    """`check()` until it returns something true; AssertionError naming `what` after
    `timeout` seconds (with the last exception, if any)."""
    end = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < end:
        try:
            value = check()
            if value:
                return value
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f}s (last error: {last!r})")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self) -> str:
        return f"--- {self.name} ({self.log}):\n" + self.log.read_text(errors="replace")[-3000:]


@dataclass
class SentinelSet:
    """A primary, one replica and three Sentinels (quorum 2), each on a free port."""

    root: Path
    server: str
    primary_port: int = field(default_factory=free_port)
    replica_port: int = field(default_factory=free_port)
    sentinel_ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"sentinel://{hosts}/0?master={MASTER}"

    def _start(self, name: str, args: list[str]) -> Proc:
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / "log.txt"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [self.server, *args],
                cwd=directory,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs[name] = Proc(name, proc, log)
        return self.procs[name]

    def _data_node(self, name: str, port: int, *extra: str) -> None:
        # The durability the README states: append-only file, fsync once a second.
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", "."]
        args += ["--appendonly", "yes", "--appendfsync", "everysec", *extra]
        self._start(name, args)

    def start(self) -> None:
        self._data_node("primary", self.primary_port)
        self._data_node(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port)
        )
        for n, port in enumerate(self.sentinel_ports, start=1):
            directory = self.root / f"sentinel{n}"
            directory.mkdir(parents=True, exist_ok=True)
            conf = directory / "sentinel.conf"  # Sentinel rewrites its file: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            self._start(f"sentinel{n}", [str(conf), "--sentinel"])
        self.wait_ready()

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def wait_ready(self) -> None:
        def replica_in_sync() -> bool:
            self.check_alive()
            info = self.client(self.replica_port).info("replication")
            return info["role"] == "slave" and info["master_link_status"] == "up"

        wait_for("the replica in sync with the primary", replica_in_sync, START_SECONDS)

        # Each Sentinel must know the replica (to promote it) and the two other Sentinels
        # (to be authorised by a majority): discovered through hello messages every ~2 s.
        def sentinels_agree() -> bool:
            self.check_alive()
            for port in self.sentinel_ports:
                node = self.client(port)
                if len(node.sentinel_sentinels(MASTER)) != 2:
                    return False
                if not [r for r in node.sentinel_slaves(MASTER) if "s_down" not in r["flags"]]:
                    return False
            return True

        wait_for(
            "three Sentinels that know each other and the replica", sentinels_agree, START_SECONDS
        )

    def check_alive(self, *, but: tuple[str, ...] = ()) -> None:
        dead = [
            p for name, p in self.procs.items() if name not in but and p.proc.poll() is not None
        ]
        assert not dead, "\n".join(p.tail() for p in dead)

    def kill(self, name: str) -> None:
        proc = self.procs[name].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs.values():
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(10)


@pytest.fixture
def sentinels(open_tmp_path):
    server = shutil.which("redis-server")
    if not server:
        pytest.fail("redis-server is not installed (apt-get install redis-server)", pytrace=False)
    cluster = SentinelSet(open_tmp_path / "redis", server)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def workers(sentinels):
    """A control worker and a collector, real `rollout worker` processes on the Sentinel URL.
    Tasks running when the primary dies cannot be acknowledged: they come back after the
    visibility timeout (kept short here, as in test_worker_loss)."""
    env = {
        "KUBECONFIG": "",
        "ROLLOUT_VISIBILITY_TIMEOUT": "10",
        "ROLLOUT_COLLECT_BLOCK_SECONDS": "2",
    }
    with LocalStack(
        collectors=1, collect_concurrency=16, external_redis_url=sentinels.url, extra_env=env
    ) as running:
        running.wait_ready()
        yield running


def test_the_primary_killed_mid_batch_fails_over_and_every_episode_counts_once(sentinels, workers):
    url = sentinels.url
    before = master_address(url)
    assert before == ("127.0.0.1", sentinels.primary_port), before

    client = RolloutClient(url)
    try:
        batch = client.submit(count=COUNT, parallelism=PARALLELISM)
        seen = []
        for row in batch.stream(timeout=120):
            seen.append(row["index"])
            if len(seen) == ROWS_BEFORE_KILL:
                break
        assert len(seen) == ROWS_BEFORE_KILL, f"the batch ended before the kill: {seen}"
        # Mid-batch: the report is not there yet.
        assert not client.redis.exists(k.report_key(batch.batch_id))

        sentinels.kill("primary")
        killed_at = time.monotonic()

        # The Sentinels elect the replica; the test fails here if no failover happens.
        after = wait_for(
            "the Sentinels naming a new master",
            lambda: (a := master_address(url)) and a != before and a,
            FAILOVER_SECONDS,
            interval=0.2,
        )
        failover_seconds = time.monotonic() - killed_at
        assert after == ("127.0.0.1", sentinels.replica_port), after
        assert sentinels.client(sentinels.replica_port).info("replication")["role"] == "master"

        try:
            report = batch.wait(REPORT_SECONDS)
        except Exception as exc:  # shown with the workers' logs
            raise AssertionError(
                f"no report after the failover: {exc!r}\n{workers_logs(workers)}"
            ) from exc
        report_seconds = time.monotonic() - killed_at
        print(
            f"\nfailover: new master after {failover_seconds:.1f}s, report "
            f"{report_seconds:.1f}s after the kill, finalized by {report.get('finalized_by')}"
        )

        indexes = sorted(row["index"] for row in report["pods"])
        lost = [row for row in report["pods"] if row.get("status") != "ok"]
        assert indexes == list(range(COUNT)), (indexes, report.get("errors"))
        assert report["episodes"] == COUNT
        assert report["collected_episodes"] == COUNT, (lost, report.get("errors"))
        assert report["successful_episodes"] == COUNT, (lost, report.get("errors"))
        assert report["lost_episodes"] == 0, lost
        assert report["reward_sum"] == COUNT
        workers.check_alive()
        sentinels.check_alive(but=("primary",))
    finally:
        client.close()

    # `rollout check` on the same URL finds the new master and a worker on every queue.
    check = subprocess.run(
        [sys.executable, "-m", "rollout_worker.cli", "check", "--no-kubernetes"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**workers.env, "ROLLOUT_REDIS_URL": url},
    )
    assert check.returncode == 0, check.stdout + check.stderr
    said = " ".join(check.stdout.split())  # the terminal library may wrap long lines
    assert f"redis: ok ({url})" in said, said
    assert "queue control: 1 worker(s)" in said and "queue collect: 1 worker(s)" in said, said

    # The workers' health check (compose, chart) on the same URL: `celery -A` the app.
    app = "rollout_worker.celery_app:app"
    destination = f"collect1@{socket.gethostname()}"
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "inspect",
            "ping",
            "-t",
            "5",
            "-d",
            destination,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**workers.env, "ROLLOUT_REDIS_URL": url},
    )
    assert probe.returncode == 0 and "pong" in probe.stdout, probe.stdout + probe.stderr


def workers_logs(stack: LocalStack) -> str:
    return "\n".join(w.log.read_text(errors="replace")[-3000:] for w in stack.workers)

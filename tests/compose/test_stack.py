"""The docker-compose stack end to end: Redis (AOF), a control worker, three collectors, Flower
and the one-shot trainer, in a local Docker engine, with a real batch through it."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from tests.compose.conftest import COLLECTORS, ComposeStack

pytestmark = [pytest.mark.compose, pytest.mark.slow]

COUNT = 30
PARALLELISM = 10


def test_the_compose_file_is_valid(stack: ComposeStack) -> None:
    done = stack.compose("config", "--quiet", timeout=60)
    assert done.returncode == 0


def test_a_batch_runs_end_to_end_and_every_collector_takes_work(stack: ComposeStack) -> None:
    started = time.monotonic()
    done = stack.client(
        "rollout",
        "run",
        "--count",
        str(COUNT),
        "--parallelism",
        str(PARALLELISM),
        "--output",
        "/out/batch-30",
        "--json",
        "--timeout",
        "240",
        timeout=360,
    )
    stack.timings["batch-30"] = round(time.monotonic() - started, 1)
    printed = json.loads(done.stdout)
    results = json.loads((stack.out_dir / "batch-30" / "results.json").read_text())
    for report in (printed, results):
        assert report["status"] == "succeeded", report.get("errors")
        assert report["episodes"] == COUNT
        assert report["successful_episodes"] == COUNT
        assert report["failed_episodes"] == 0 and report["lost_episodes"] == 0
        assert report["reward_sum"] == COUNT
    assert len(results["pods"]) == COUNT
    # The control worker's security options let bubblewrap work inside Docker.
    assert results["run_isolation"] == "bwrap"
    assert results["warnings"] == []

    totals = _collect_totals(stack)
    assert len(totals) == COLLECTORS, totals
    assert all(n > 0 for n in totals.values()), totals
    # Requeued collections count again, so at least one task per episode.
    assert sum(totals.values()) >= COUNT


def _collect_totals(stack: ComposeStack) -> dict[str, int]:
    """rollout.collect_episode tasks run per collector node, from `celery inspect stats`."""
    done = stack.compose(
        "exec",
        "-T",
        "control",
        "sh",
        "-c",
        'celery --broker "$ROLLOUT_REDIS_URL" inspect stats --timeout 5 --json',
        timeout=60,
    )
    stats = json.loads(done.stdout)
    return {
        node: int(info.get("total", {}).get("rollout.collect_episode", 0))
        for node, info in stats.items()
        if node.startswith("collect@")
    }


def test_flower_sees_the_workers_through_celery_events(stack: ComposeStack) -> None:
    address = stack.port("flower", 5555)
    with urllib.request.urlopen(f"http://{address}/healthcheck", timeout=10) as reply:
        assert reply.read() == b"OK"
    end = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"http://{address}/workers?json=1", timeout=10) as reply:
            workers = {w["hostname"]: w for w in json.loads(reply.read())["data"]}
        collectors = [name for name in workers if name.startswith("collect@")]
        if len(collectors) == COLLECTORS and any(n.startswith("control@") for n in workers):
            break
        assert time.monotonic() < end, f"flower lists {sorted(workers)}"
        time.sleep(1)


def test_the_trainer_one_shot_service_runs_its_rounds(stack: ComposeStack) -> None:
    # The service's own command: trainer-stub --rounds 2 --count 5 (set by the fixture).
    done = stack.client(timeout=300)
    assert done.returncode == 0
    assert "succeeded" in done.stdout


def _redis_cli(stack: ComposeStack, *args: str, check: bool = True):
    return stack.compose("exec", "-T", "redis", "redis-cli", *args, timeout=60, check=check)


def _wait_redis_answers(stack: ComposeStack, timeout: float = 60) -> None:
    """PONG from redis-cli, once the restarted server has loaded its data."""
    end = time.monotonic() + timeout
    while True:
        done = _redis_cli(stack, "ping", check=False)
        if done.returncode == 0 and done.stdout.strip() == "PONG":
            return
        assert time.monotonic() < end, f"redis did not answer after restart: {done.stderr}"
        time.sleep(1)


def test_redis_data_survives_a_hard_restart_through_the_append_only_file(
    stack: ComposeStack,
) -> None:
    """Kill Redis with SIGKILL (no shutdown save), start it again, and read back a key and a
    finished batch's report: what was written before the kill came back from the AOF."""
    done = stack.client("rollout", "run", "--count", "3", "--json", "--timeout", "180", timeout=300)
    batch = json.loads(done.stdout)
    assert batch["status"] == "succeeded", batch.get("errors")
    report_key = f"rollout:batch:{batch['batch_id']}:report"
    report_before = _redis_cli(stack, "get", report_key).stdout.strip()
    assert json.loads(report_before)["batch_id"] == batch["batch_id"]
    marker = f"aof-{uuid.uuid4().hex}"
    assert _redis_cli(stack, "set", "rollout:test:aof-marker", marker).stdout.strip() == "OK"
    # The marker is newer than any RDB snapshot, so no snapshot can bring it back.
    persistence = _redis_cli(stack, "info", "persistence").stdout
    assert _field(persistence, "rdb_bgsave_in_progress") == "0", persistence
    assert int(_field(persistence, "rdb_changes_since_last_save")) > 0, persistence
    run_id_before = _server_field(stack, "run_id")
    aof_loads_before = _aof_loads(stack)
    time.sleep(2)  # appendfsync everysec: the AOF is on disk within a second

    stack.compose("kill", "--signal", "SIGKILL", "redis", timeout=60)
    stack.compose("start", "redis", timeout=120)
    _wait_redis_answers(stack)

    assert _server_field(stack, "run_id") != run_id_before  # a new server process
    assert _field(_redis_cli(stack, "info", "persistence").stdout, "aof_enabled") == "1"
    # The new server loaded its data from the append-only file (Redis 7 logs it so).
    assert _aof_loads(stack) > aof_loads_before
    assert _redis_cli(stack, "get", "rollout:test:aof-marker").stdout.strip() == marker
    assert _redis_cli(stack, "get", report_key).stdout.strip() == report_before
    # The stack works on after the restart (the workers reconnect).
    again = stack.client(
        "rollout", "run", "--count", "2", "--json", "--timeout", "180", timeout=300
    )
    assert json.loads(again.stdout)["status"] == "succeeded"


def _server_field(stack: ComposeStack, name: str) -> str:
    return _field(_redis_cli(stack, "info", "server").stdout, name)


def _aof_loads(stack: ComposeStack) -> int:
    logs = stack.compose("logs", "--no-color", "redis", timeout=60).stdout
    return logs.count("DB loaded from append only file")


def _field(info: str, name: str) -> str:
    return next(
        line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(f"{name}:")
    )

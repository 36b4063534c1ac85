"""The docker-compose stack end to end: Redis (AOF), a control worker, three collectors, Flower
and the one-shot trainer, in a local Docker engine, with a real batch through it."""

from __future__ import annotations

import json
import time
import urllib.request

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


def test_redis_keeps_an_append_only_file(stack: ComposeStack) -> None:
    done = stack.compose("exec", "-T", "redis", "redis-cli", "config", "get", "appendonly")
    assert done.stdout.split() == ["appendonly", "yes"]

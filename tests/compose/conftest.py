"""Fixtures for the docker-compose stack, run for real in a local Docker engine.

The engine is started by hack/docker-up.sh when none answers, the images are built locally
(a debootstrap base, a host wheelhouse: no registry, no PyPI inside the build), and the stack
runs under a unique project name with three collectors. A Docker that cannot start fails the
tests; nothing is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COLLECTORS = 3
# Fewer slots than a batch has episodes, so every collector has to take some of them.
COLLECT_CONCURRENCY = 4
UP_TIMEOUT = 240


def _run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, check=True):
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
            f"\n--- stderr\n{done.stderr[-4000:]}",
            pytrace=False,
        )
    return done


def _timed(label: str, timings: dict[str, float], cmd: list[str], **kwargs):
    start = time.monotonic()
    done = _run(cmd, **kwargs)
    timings[label] = round(time.monotonic() - start, 1)
    print(f"compose stack: {label} took {timings[label]}s", file=sys.stderr)
    return done


@pytest.fixture(scope="session")
def timings() -> dict[str, float]:
    return {}


@pytest.fixture(scope="session")
def docker_ready(timings: dict[str, float]) -> None:
    """A local engine answering and compose v2, installed and started when missing."""
    _timed("docker-up", timings, ["bash", "hack/docker-up.sh"], timeout=1200)


@pytest.fixture(scope="session")
def images(docker_ready: None, timings: dict[str, float]) -> dict[str, str]:
    """ROLLOUT_IMAGE and ROLLOUT_REDIS_IMAGE, built from a local debootstrap base."""
    done = _timed(
        "build-images", timings, ["bash", "docker/build-image.sh", "--local-base"], timeout=1200
    )
    values = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    assert set(values) == {"ROLLOUT_IMAGE", "ROLLOUT_REDIS_IMAGE"}, done.stdout
    return values


@dataclass
class ComposeStack:
    project: str
    env: dict[str, str]
    out_dir: Path
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 300, check: bool = True):
        return _run(
            ["docker", "compose", "-p", self.project, *args],
            env=self.env,
            timeout=timeout,
            check=check,
        )

    def client(self, *args: str, timeout: float = 300, check: bool = True):
        """A one-shot command in the trainer service (the image's CLIs, on the stack network).

        --no-deps: `compose run` would otherwise reconcile the scaled collectors back to one.
        """
        return self.compose(
            "run", "--rm", "--no-deps", "-T", "trainer", *args, timeout=timeout, check=check
        )

    def port(self, service: str, private: int) -> str:
        return self.compose("port", service, str(private), timeout=30).stdout.strip()


# Module scope: the stack's healthchecks (a `celery inspect ping` per worker every 10 s) cost
# about a fifth of a core here; kept up for the session, they slowed every later test.
@pytest.fixture(scope="module")
def stack(
    images: dict[str, str], tmp_path_factory: pytest.TempPathFactory, timings: dict[str, float]
) -> Iterator[ComposeStack]:
    out_dir = tmp_path_factory.mktemp("compose-out")
    env = {
        **os.environ,
        **images,
        "ROLLOUT_OUT_DIR": str(out_dir),
        # Random host ports on loopback: nothing clashes with a Redis or Flower already there.
        "ROLLOUT_REDIS_PORT": "127.0.0.1:",
        "ROLLOUT_FLOWER_PORT": "127.0.0.1:",
        "ROLLOUT_COLLECT_CONCURRENCY": str(COLLECT_CONCURRENCY),
        "ROLLOUT_TRAINER_ROUNDS": "2",
        "ROLLOUT_TRAINER_COUNT": "5",
    }
    running = ComposeStack(f"rollout-test-{uuid.uuid4().hex[:8]}", env, out_dir, timings)
    try:
        start = time.monotonic()
        running.compose(
            "up",
            "--detach",
            "--no-build",
            "--wait",
            "--wait-timeout",
            str(UP_TIMEOUT),
            "--scale",
            f"collect={COLLECTORS}",
            timeout=UP_TIMEOUT + 60,
        )
        timings["compose-up"] = round(time.monotonic() - start, 1)
        yield running
    finally:
        logs = running.compose("logs", "--no-color", "--tail", "60", timeout=60, check=False)
        print(f"--- compose logs ({running.project})\n{logs.stdout[-8000:]}", file=sys.stderr)
        running.compose(
            "down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180, check=False
        )
        print(f"compose stack timings: {timings}", file=sys.stderr)

"""Shared fixtures. Tests that need Redis or workers start real ones: a missing redis-server
is a failure, never a skip."""

from __future__ import annotations

import pytest

from rollout_worker.stack import LocalStack
from trainer_stub.client import RolloutClient


@pytest.fixture(scope="session")
def stack():
    """A private redis-server, one `control` worker and two `collect` workers (real processes)."""
    with LocalStack(collectors=2, extra_env={"ROLLOUT_MAX_BATCH_EPISODES": "300"}) as running:
        yield running


@pytest.fixture
def client(stack):
    stack.check_alive()
    rollout = RolloutClient(stack.redis_url)
    yield rollout
    rollout.close()

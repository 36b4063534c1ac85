"""What a local run tells Redis as its episodes go: progress for the trainer, and the signal
that wakes an episode's collector when it ends."""

from __future__ import annotations

import contextlib
from typing import Any

import redis

from rollout_wire.redis_url import redis_client
from rollout_worker.backends.local.signal import DoneSignal
from rollout_worker.store import Store


class Reporter:
    """Streams episode progress to the trainer and wakes an episode's collector when it ends.
    Best effort: Redis being away never fails an episode (collectors then read the folder)."""

    def __init__(self, settings: dict[str, Any] | None) -> None:
        self.batch_id = settings["batch_id"] if settings else None
        self.store: Store | None = None
        self.signal: DoneSignal | None = None
        if settings:
            client = redis_client(settings["redis_url"], socket_timeout=2, socket_connect_timeout=2)
            self.store = Store(client, int(settings["ttl"]))
            self.signal = DoneSignal(client)

    def __call__(self, index: int, state: str) -> None:
        if self.store is None or self.signal is None or self.batch_id is None:
            return
        with contextlib.suppress(redis.RedisError):
            if state == "done":
                self.signal.notify(self.batch_id, index)
            else:
                self.store.publish_state(self.batch_id, index, state)

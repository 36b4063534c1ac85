"""How the local supervisor wakes the collector of an episode that just ended, instead of the
collector polling the run folder: a Redis list per episode, pushed once, popped by BLPOP."""

from __future__ import annotations

import time

import redis

from rollout_wire import constants as k
from rollout_wire.redis_url import redis_client

# A signal nobody consumed is useless after this.
SIGNAL_TTL = 3600
# Without Redis, a waiting collector falls back to polling the run folder this often.
POLL_SECONDS = 0.02


class DoneSignal:
    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    @classmethod
    def from_url(cls, url: str, *, socket_timeout: float | None = None) -> DoneSignal:
        return cls(redis_client(url, socket_timeout=socket_timeout, socket_connect_timeout=2))

    def notify(self, batch_id: str, index: int) -> None:
        key = k.done_key(batch_id, index)
        pipe = self.redis.pipeline()
        pipe.rpush(key, 1)
        pipe.expire(key, SIGNAL_TTL)
        pipe.execute()

    def wait(self, batch_id: str, index: int, timeout: float) -> None:
        """Return when episode `index` is signalled done or `timeout` passed (or, without
        Redis, after a short poll interval: the caller looks at the run folder either way)."""
        key = k.done_key(batch_id, index)
        try:
            if self.redis.blpop([key], timeout=max(0.01, timeout)) is not None:
                # Put the token back: another copy of the same collect task may be waiting too
                # (redelivery), and it must wake as well. Waiters read the status file first,
                # so a token left behind costs nothing.
                self.notify(batch_id, index)
        except redis.RedisError:
            time.sleep(min(POLL_SECONDS, timeout))

    def wait_any(self, batch_id: str, indexes: list[int], timeout: float) -> None:
        """`wait` for the first of several episodes (one BLPOP on all their lists)."""
        keys = [k.done_key(batch_id, index) for index in indexes]
        try:
            popped = self.redis.blpop(keys, timeout=max(0.01, timeout))
            if popped is not None:
                self.redis.rpush(popped[0], 1)  # its own collector must wake too
        except redis.RedisError:
            time.sleep(min(POLL_SECONDS, timeout))

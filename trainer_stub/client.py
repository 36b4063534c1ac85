"""A small client for trainers: submit a batch, stream its episodes, wait for its report.

Waiting reads the batch's Redis stream (XREAD BLOCK): no Celery result polling, and a trainer
that subscribes late still sees every entry. One call can wait on many batches at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
from celery import Celery

from rollout_worker import constants as k
from rollout_worker.errors import BatchTimeout
from rollout_worker.models import new_batch_id, parse_spec

BLOCK_MS = 1000
NO_CLIENT_LIMIT = 10**9  # the worker enforces the configured maximum batch size


@dataclass
class Submission:
    batch_id: str
    spec: dict[str, Any]
    submitted_at: float
    started: float = field(default_factory=time.monotonic)


@dataclass
class Entry:
    """One stream entry: an episode's progress state, its row once collected, or the report."""

    type: str
    index: int | None = None
    row: dict[str, Any] | None = None
    status: str | None = None


class RolloutClient:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.redis = redis.Redis.from_url(redis_url)
        self.celery = Celery("rollout-trainer", broker=redis_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True
        )

    def submit(self, **request: Any) -> Submission:
        """Validate and send one batch; returns at once with its id."""
        request.setdefault("batch_id", new_batch_id())
        request["submitted_at"] = time.time()
        parse_spec(request, max_episodes=NO_CLIENT_LIMIT)  # raises InvalidSpec before sending
        submit_batch = self.celery.signature(k.TASK_SUBMIT, queue=k.QUEUE_CONTROL)
        submit_batch.delay(request)
        return Submission(request["batch_id"], request, request["submitted_at"])

    # -- reading -----------------------------------------------------------------------------
    def entries(
        self,
        batch_ids: list[str],
        timeout: float | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> Iterator[tuple[str, Entry]]:
        """Yield (batch_id, entry) from all batches' streams until each has its report.

        `heartbeat` runs about once a second while waiting; an exception from it stops the wait.
        """
        cursors = {k.stream_key(b): "0-0" for b in batch_ids}
        names = {k.stream_key(b): b for b in batch_ids}
        deadline = None if timeout is None else time.monotonic() + timeout
        while cursors:
            block = BLOCK_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BatchTimeout(
                        f"no report within {timeout:.0f}s for batch(es) "
                        f"{sorted(names[s] for s in cursors)}"
                    )
                block = max(1, min(BLOCK_MS, int(remaining * 1000)))
            if heartbeat is not None:
                heartbeat()
            for stream, items in self.redis.xread(cursors, block=block) or []:
                stream = stream.decode()
                for entry_id, data in items:
                    cursors[stream] = entry_id
                    entry = _entry(data)
                    yield names[stream], entry
                    if entry.type == k.ENTRY_REPORT:
                        del cursors[stream]
                        break

    def stream(self, batch_id: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Episode rows as they are collected (early rewards), ending when the report is out."""
        for _, entry in self.entries([batch_id], timeout):
            if entry.type == k.ENTRY_EPISODE and entry.row is not None:
                yield entry.row

    def wait(self, batch_id: str, timeout: float | None = None) -> dict[str, Any]:
        return self.wait_many([batch_id], timeout)[batch_id]

    def wait_many(
        self,
        batch_ids: list[str],
        timeout: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        reports: dict[str, dict[str, Any]] = {}
        for batch_id, entry in self.entries(batch_ids, timeout):
            if entry.type == k.ENTRY_REPORT:
                reports[batch_id] = self.report(batch_id) or {}
        return reports

    def report(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(k.report_key(batch_id))
        return None if raw is None else orjson.loads(raw)

    def receipt(self, batch_id: str) -> dict[str, Any]:
        raw = self.redis.hgetall(k.receipt_key(batch_id))
        return {name.decode(): orjson.loads(value) for name, value in raw.items()}

    def logs(self, batch_id: str) -> dict[int, str]:
        raw = self.redis.hgetall(k.logs_key(batch_id))
        return {int(index): text.decode("utf-8", "replace") for index, text in raw.items()}

    def records(self, batch_id: str) -> dict[str, str]:
        raw = self.redis.hgetall(k.artifacts_key(batch_id))
        return {name.decode(): text.decode("utf-8", "replace") for name, text in raw.items()}

    def close(self) -> None:
        self.redis.close()
        self.celery.close()


def _entry(data: Mapping[bytes, bytes]) -> Entry:
    kind = data[b"type"].decode()
    if kind == k.ENTRY_EPISODE:
        return Entry(kind, index=int(data[b"index"]), row=orjson.loads(data[b"row"]))
    if kind == k.ENTRY_STATE:
        return Entry(kind, index=int(data[b"index"]), status=data[b"state"].decode())
    return Entry(kind, status=data.get(b"status", b"").decode())

"""The trainer's client: submit sampling rounds, stream their episodes, wait for their reports.

Waiting reads each batch's Redis stream (XREAD BLOCK): no Celery result polling, and a trainer
that subscribes late still sees every entry. One call can wait on many batches at once.
Everything read from Redis is decoded by `rollout_wire.codec`, the codec the workers write with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from rollout_wire import codec
from rollout_wire import constants as k
from rollout_wire.codec import Entry
from rollout_wire.errors import BatchTimeout, RedisUnavailable
from rollout_wire.request import BatchSpec, parse_spec
from rollout_wire.trajectory import trajectory_from_log
from rollout_wire.urls import redacted

BLOCK_MS = 1000
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# A restart of Redis is waited out; Redis away for longer than this ends the wait with an error.
REDIS_OUTAGE_SECONDS = 60.0


@dataclass
class Submission:
    """A batch sent to the workers. `wait()` returns its report; `stream()` its rows early."""

    spec: BatchSpec
    client: RolloutClient = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    # Seconds from just before the send to this client seeing the report (set by whoever
    # reads the report entry through this client: `wait`, `follow`).
    submit_to_report_seconds: float | None = None

    @property
    def batch_id(self) -> str:
        return self.spec.batch_id

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        report = self.client.wait(self.batch_id, timeout)
        self.saw_report()
        return report

    def stream(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        yield from self.client.stream(self.batch_id, timeout)
        self.saw_report()

    def cancel(self) -> None:
        self.client.cancel(self.batch_id)

    def saw_report(self) -> None:
        if self.submit_to_report_seconds is None:
            self.submit_to_report_seconds = time.monotonic() - self.started


class RolloutClient:
    def __init__(self, redis_url: str, *, outage_seconds: float = REDIS_OUTAGE_SECONDS) -> None:
        self.redis_url = redis_url
        self.outage_seconds = outage_seconds
        self.redis = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
        self.celery = Celery("rollout-trainer", broker=redis_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True
        )

    # -- sending -----------------------------------------------------------------------------
    @staticmethod
    def prepare(request: Mapping[str, Any], max_episodes: int | None = None) -> BatchSpec:
        """Validate a request (raises InvalidSpec listing every problem); mints its batch id.
        `max_episodes`: the deployment's limit when known here (the workers enforce it too)."""
        return parse_spec(request, max_episodes=max_episodes)

    def send(self, spec: BatchSpec) -> Submission:
        """Send a prepared batch to the workers' control queue; returns at once."""
        submission = Submission(spec, self)
        self.celery.send_task(k.TASK_SUBMIT, args=(spec.to_dict(),), queue=k.QUEUE_CONTROL)
        return submission

    def submit(self, **request: Any) -> Submission:
        return self.send(self.prepare(request))

    def cancel(self, batch_id: str) -> None:
        """Ask the workers to stop a batch; its report then says `cancelled` with what had
        finished (wait for it as for any report)."""
        self.celery.send_task(k.TASK_CANCEL, args=(batch_id,), queue=k.QUEUE_CONTROL)

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
        down_since: float | None = None
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
            try:
                found = self.redis.xread(cursors, block=block) or []
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # A restarting Redis (with its AOF) comes back with every entry: wait it out.
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > self.outage_seconds:
                    raise RedisUnavailable(
                        f"Redis at {redacted(self.redis_url)} unreachable for "
                        f"{self.outage_seconds:.0f}s while waiting for batch(es) "
                        f"{sorted(names[s] for s in cursors)}: {exc}"
                    ) from exc
                time.sleep(0.5)
                continue
            down_since = None
            for stream, items in found:
                stream = stream.decode()
                for entry_id, data in items:
                    cursors[stream] = entry_id
                    entry = codec.decode_entry(data)
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
        self, batch_ids: list[str], timeout: float | None = None
    ) -> dict[str, dict[str, Any]]:
        reports: dict[str, dict[str, Any]] = {}
        for batch_id, entry in self.entries(batch_ids, timeout):
            if entry.type == k.ENTRY_REPORT:
                reports[batch_id] = self.report(batch_id) or {}
        return reports

    def report(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(k.report_key(batch_id))
        return None if raw is None else codec.loads(raw)

    def receipt(self, batch_id: str) -> dict[str, Any]:
        return codec.decode_fields(self.redis.hgetall(k.receipt_key(batch_id)))

    def logs(self, batch_id: str) -> dict[int, str]:
        raw = codec.decode_text_hash(self.redis.hgetall(k.logs_key(batch_id)))
        return {int(index): text for index, text in raw.items()}

    # -- trajectories (real rollouts) -------------------------------------------------------
    def trajectory(self, batch_id: str, index: int) -> dict[str, Any] | None:
        """Episode `index`'s trajectory (steps with actions, observations and the policy's
        verbatim responses, then the outcome): the stored one, else read from its stored log
        (the validated record it is made from). None before the episode is collected."""
        raw = self.redis.hget(k.trajectories_key(batch_id), str(index))
        if raw is not None:
            value: dict[str, Any] = codec.loads(raw)
            return value
        log = self.redis.hget(k.logs_key(batch_id), str(index))
        return None if log is None else trajectory_from_log(log.decode("utf-8", "replace"))

    def trajectories(
        self, batch_id: str, timeout: float | None = None
    ) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
        """(row, trajectory) per episode as each is collected, ending with the report. A row
        that is not ok carries `failure_kind` (`infrastructure` rows are no samples)."""
        for row in self.stream(batch_id, timeout):
            yield row, self.trajectory(batch_id, int(row["index"]))

    def records(self, batch_id: str) -> dict[str, str]:
        return codec.decode_text_hash(self.redis.hgetall(k.artifacts_key(batch_id)))

    def close(self) -> None:
        self.redis.close()
        self.celery.close()


class SubmitBatch:
    """The trainer's entry point, shaped like the Celery task it sends:

        from trainer_stub import submit_batch
        batch = submit_batch.delay(count=100, parallelism=20)
        report = batch.wait()

    Redis is `ROLLOUT_REDIS_URL` (read at the first call) unless `configure()` said otherwise.
    """

    def __init__(self) -> None:
        self._client: RolloutClient | None = None

    def configure(self, redis_url: str) -> RolloutClient:
        if self._client is not None:
            self._client.close()
        self._client = RolloutClient(redis_url)
        return self._client

    @property
    def client(self) -> RolloutClient:
        if self._client is None:
            self._client = RolloutClient(os.environ.get("ROLLOUT_REDIS_URL") or DEFAULT_REDIS_URL)
        return self._client

    def delay(self, **request: Any) -> Submission:
        """Validate the request here (InvalidSpec before anything is sent) and send it."""
        return self.client.submit(**request)


submit_batch = SubmitBatch()

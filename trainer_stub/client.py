"""The trainer's client: submit sampling rounds, stream their episodes, wait for their reports.

Waiting reads each batch's Redis stream (XREAD BLOCK): no Celery result polling, and a trainer
that subscribes late still sees every entry. One call can wait on many batches at once.
Everything read from Redis is decoded by `rollout_wire.codec`, the codec the workers write with.
"""

from __future__ import annotations

import math
import os
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import kombu.exceptions
import redis
from celery import Celery

from rollout_wire import codec
from rollout_wire import constants as k
from rollout_wire.codec import Entry
from rollout_wire.errors import BatchTimeout, ConfigError, RedisUnavailable
from rollout_wire.policy import DEFAULT_TRAINER
from rollout_wire.redis_url import celery_settings, redis_client
from rollout_wire.request import BatchSpec, parse_spec
from rollout_wire.states import GroupFilter
from rollout_wire.tokens import token_view
from rollout_wire.trajectory import trajectory_from_log
from rollout_wire.urls import redacted
from trainer_stub.sampling import ContinuousSampler, Following

BLOCK_MS = 1000
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# A restart of Redis is waited out; Redis away for longer than this ends the wait with an error.
REDIS_OUTAGE_SECONDS = 60.0
OUTAGE_ENV = "ROLLOUT_REDIS_OUTAGE_SECONDS"  # overrides REDIS_OUTAGE_SECONDS for a client
RETRY_SECONDS = 0.5  # between two tries of a Redis call while Redis is unreachable
# One try of a send (kombu connects, publishes, retries once) stays this short, so a send to an
# unreachable Redis fails within the outage limit like every other call.
SEND_CONNECT_SECONDS = 5.0
# What "Redis is not reachable right now" looks like: redis-py's errors (a restarting Redis
# that is still loading its AOF is one too), kombu's when it sends a task, and socket errors.
UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    kombu.exceptions.OperationalError,
    OSError,
)
# What no wait fixes: a refused password or user, or something else than Redis answering.
UNUSABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.InvalidResponse,
)

T = TypeVar("T")


def outage_seconds_from_env() -> float:
    """`ROLLOUT_REDIS_OUTAGE_SECONDS` when set (seconds > 0), else REDIS_OUTAGE_SECONDS."""
    raw = os.environ.get(OUTAGE_ENV, "").strip()
    if not raw:
        return REDIS_OUTAGE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{OUTAGE_ENV}={raw!r} must be a number of seconds above 0")
    return value


@dataclass
class Submission:
    """A batch sent to the workers. `wait()` returns its report; `stream()` its rows early."""

    spec: BatchSpec
    client: RolloutClient = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    # Seconds from just before the send to this client seeing the report (set by whoever
    # reads the report entry through this client: `wait`, `follow`).
    submit_to_report_seconds: float | None = None
    # Seconds from just before the send to this client seeing the run completed (the Job's
    # Complete/Failed, recorded in the receipt as `completed_at` after the report): the guide's
    # `client_job_complete_seconds`, polling included. Set by whoever reads that receipt
    # through `saw_receipt` (`rollout run --output` does).
    submit_to_job_complete_seconds: float | None = None

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

    def saw_receipt(self, receipt: Mapping[str, Any]) -> None:
        """Called with each receipt (or report) this client reads: the first one saying the
        run completed (`completed_at`) stops the guide's submit -> Job complete clock."""
        if self.submit_to_job_complete_seconds is None and receipt.get("completed_at"):
            self.submit_to_job_complete_seconds = time.monotonic() - self.started

    def receipt(self) -> dict[str, Any]:
        """The workers' receipt of this batch (marks the run's completion when it says so)."""
        receipt = self.client.receipt(self.batch_id)
        self.saw_receipt(receipt)
        return receipt


class RolloutClient:
    """Every Redis call goes through `call`: an outage (a restart) is waited out for up to
    `outage_seconds` (default `ROLLOUT_REDIS_OUTAGE_SECONDS`, else 60), then RedisUnavailable."""

    def __init__(self, redis_url: str, *, outage_seconds: float | None = None) -> None:
        self.redis_url = redis_url
        self.outage_seconds = (
            outage_seconds_from_env() if outage_seconds is None else float(outage_seconds)
        )
        self.redis = redis_client(redis_url, socket_connect_timeout=5)
        # A Sentinel URL becomes kombu's form plus master_name (rollout_wire.redis_url).
        broker = {n: v for n, v in celery_settings(redis_url).items() if n.startswith("broker_")}
        self.celery = Celery("rollout-trainer", broker=broker["broker_url"], set_as_current=False)
        self.celery.conf.update({n: v for n, v in broker.items() if v})
        connect = min(SEND_CONNECT_SECONDS, self.outage_seconds)
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            broker_connection_retry_on_startup=True,
            # kombu's own retries of one send stay short; `call` waits out the outage.
            broker_connection_timeout=connect,
            task_publish_retry_policy={
                "max_retries": 1,
                "interval_start": 0,
                "interval_step": 0.2,
                "interval_max": 0.2,
            },
        )

    # -- every Redis call ----------------------------------------------------------------------
    def call(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` (one Redis command, or one task sent through kombu), tried again every
        RETRY_SECONDS while Redis is unreachable; unreachable for `outage_seconds` since the
        first failed try: RedisUnavailable (one line naming the URL, password masked).
        `what` completes "... unreachable for Ns while <what>"."""
        down_since: float | None = None
        while True:
            tried_at = time.monotonic()
            try:
                return fn()
            except UNUSABLE as exc:
                raise RedisUnavailable(  # no outage: waiting would not help
                    f"Redis at {redacted(self.redis_url)} cannot be used while {what}: "
                    f"{self._cause(exc)}"
                ) from exc
            except UNREACHABLE as exc:
                down_since = tried_at if down_since is None else down_since
                waited = time.monotonic() - down_since
                if waited >= self.outage_seconds:
                    raise self._unavailable(what, exc) from exc
                time.sleep(min(RETRY_SECONDS, self.outage_seconds - waited))

    def _unavailable(self, what: str, exc: BaseException) -> RedisUnavailable:
        return RedisUnavailable(
            f"Redis at {redacted(self.redis_url)} unreachable for {self.outage_seconds:g}s "
            f"while {what}: {self._cause(exc)}"
        )

    def _cause(self, exc: BaseException) -> str:
        """The error's text on one line, without the URL's password."""
        cause = " ".join(str(exc).split()) or type(exc).__name__
        password = _password(self.redis_url)
        return cause.replace(password, "***") if password else cause

    # -- sending -----------------------------------------------------------------------------
    @staticmethod
    def prepare(request: Mapping[str, Any], max_episodes: int | None = None) -> BatchSpec:
        """Validate a request (raises InvalidSpec listing every problem); mints its batch id.
        `max_episodes`: the deployment's limit when known here (the workers enforce it too)."""
        return parse_spec(request, max_episodes=max_episodes)

    def send(self, spec: BatchSpec) -> Submission:
        """Send a prepared batch to the workers' control queue; returns once it is queued.
        Redis unreachable for the outage limit: RedisUnavailable (nothing was queued, or a
        copy that the workers' idempotent submit takes once)."""
        submission = Submission(spec, self)
        self._send_task(f"sending batch {spec.batch_id}", k.TASK_SUBMIT, spec.to_dict())
        return submission

    def _send_task(self, what: str, name: str, *args: Any) -> None:
        # One task id for every try: a resend after a lost reply is the same message.
        task_id = str(uuid.uuid4())
        self.call(
            what,
            lambda: self.celery.send_task(name, args=args, queue=k.QUEUE_CONTROL, task_id=task_id),
        )

    def submit(self, **request: Any) -> Submission:
        """Validate and send. A real rollout records the policy version its trainer published
        last (`publish_policy_version`) unless the request names one."""
        policy = request.get("policy")
        if isinstance(policy, Mapping) and request.get("policy_version") is None:
            version = self.policy_version(str(policy.get("trainer") or DEFAULT_TRAINER))
            if version is not None:
                request = request | {"policy_version": version}
        return self.send(self.prepare(request))

    # -- policy versions ----------------------------------------------------------------------
    def publish_policy_version(self, version: int | str, trainer: str = DEFAULT_TRAINER) -> None:
        """Say which policy version the trainer is at now: batches with `max_policy_lag` call
        a sample stale when its first turn is more than that many versions behind (integers
        are compared; other versions are only recorded)."""
        key = k.policy_version_key(trainer)
        self.call(f"publishing policy version {version}", lambda: self.redis.set(key, str(version)))

    def policy_version(self, trainer: str = DEFAULT_TRAINER) -> str | None:
        key = k.policy_version_key(trainer)
        raw = self.call("reading the policy version", lambda: self.redis.get(key))
        return None if raw is None else raw.decode()

    def sample(
        self,
        tasks: Sequence[Mapping[str, Any]],
        samples_per_task: int,
        *,
        groups_in_flight: int,
        total_groups: int | None = None,
        group_filter: str = GroupFilter.ANY,
        refill_at: int | None = None,
        timeout: float | None = None,
        **request: Any,
    ) -> Iterator[dict[str, Any]]:
        """Continuous sampling (`sampling.ContinuousSampler`): groups as they complete, with
        `groups_in_flight` groups kept running by submitting batches as groups finish. See
        the sampler for the arguments; closing the iterator cancels what is in flight."""
        sampler = ContinuousSampler(
            self,
            tasks,
            samples_per_task,
            groups_in_flight=groups_in_flight,
            total_groups=total_groups,
            group_filter=group_filter,
            refill_at=refill_at,
            request=request,
        )
        return sampler.groups(timeout)

    def cancel(self, batch_id: str) -> None:
        """Ask the workers to stop a batch; its report then says `cancelled` with what had
        finished (wait for it as for any report)."""
        self._send_task(f"cancelling batch {batch_id}", k.TASK_CANCEL, batch_id)

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
        return self.follow(Following(batch_ids), timeout, heartbeat)

    def follow(
        self,
        following: Following,
        timeout: float | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> Iterator[tuple[str, Entry]]:
        """`entries` over a set of batches the caller may add to while it reads (continuous
        sampling adds the batches it submits); ends when none is left without its report."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cursors = following.cursors
        while cursors:
            block = BLOCK_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BatchTimeout(
                        f"no report within {timeout:.0f}s for batch(es) {following.waiting()}"
                    )
                block = max(1, min(BLOCK_MS, int(remaining * 1000)))
            if heartbeat is not None:
                heartbeat()

            def read(block: int = block) -> Any:
                return self.redis.xread(dict(cursors), block=block)

            # A restarting Redis comes back with its entries (from its AOF, but for the last
            # second's writes at most, which are streamed again): wait it out.
            waiting = f"waiting for batch(es) {following.waiting()}"
            found = self.call(waiting, read) or []
            for stream, items in found:
                stream = stream.decode()
                for entry_id, data in items:
                    if stream not in cursors:
                        break  # reported (or dropped by the caller) while this was read
                    cursors[stream] = entry_id
                    entry = codec.decode_entry(data)
                    if entry.once is not None:
                        given = following.given.setdefault(stream, set())
                        if entry.once in given:
                            continue
                        given.add(entry.once)
                    if entry.type == k.ENTRY_REPORT:
                        del cursors[stream]
                        following.given.pop(stream, None)
                    yield following.names[stream], entry
                    if entry.type == k.ENTRY_REPORT:
                        break

    def stream(self, batch_id: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Episode rows as they are collected (early rewards), ending when the report is out."""
        for _, entry in self.entries([batch_id], timeout):
            if entry.type == k.ENTRY_EPISODE and entry.row is not None:
                yield entry.row

    def groups(self, batch_id: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """The batch's groups as each completes (its last sample has its row, whatever its
        status), ending when the report is out. Each carries the report's group figures plus
        `varied` and `counted` (it made the batch's `groups_wanted`)."""
        for _, entry in self.entries([batch_id], timeout):
            if entry.type == k.ENTRY_GROUP and entry.group is not None:
                yield entry.group

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
        raw = self.call(
            f"reading the report of batch {batch_id}",
            lambda: self.redis.get(k.report_key(batch_id)),
        )
        return None if raw is None else codec.loads(raw)

    def receipt(self, batch_id: str) -> dict[str, Any]:
        raw = self.call(
            f"reading the receipt of batch {batch_id}",
            lambda: self.redis.hgetall(k.receipt_key(batch_id)),
        )
        return codec.decode_fields(raw)

    def logs(self, batch_id: str) -> dict[int, str]:
        raw = self.call(
            f"reading the logs of batch {batch_id}",
            lambda: self.redis.hgetall(k.logs_key(batch_id)),
        )
        return {int(index): text for index, text in codec.decode_text_hash(raw).items()}

    # -- trajectories (real rollouts) -------------------------------------------------------
    def trajectory(self, batch_id: str, index: int) -> dict[str, Any] | None:
        """Episode `index`'s trajectory (steps with actions, observations and the policy's
        verbatim responses, then the outcome): the stored one, else read from its stored log
        (the validated record it is made from). None before the episode is collected."""
        what = f"reading the trajectory of episode {index} of batch {batch_id}"
        raw = self.call(what, lambda: self.redis.hget(k.trajectories_key(batch_id), str(index)))
        if raw is not None:
            value: dict[str, Any] = codec.loads(raw)
            return value
        log = self.call(what, lambda: self.redis.hget(k.logs_key(batch_id), str(index)))
        return None if log is None else trajectory_from_log(log.decode("utf-8", "replace"))

    def trajectories(
        self, batch_id: str, timeout: float | None = None
    ) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
        """(row, trajectory) per episode as each is collected, ending with the report. A row
        that is not ok carries `failure_kind` (`infrastructure` rows are no samples)."""
        for row in self.stream(batch_id, timeout):
            yield row, self.trajectory(batch_id, int(row["index"]))

    def tokens(self, batch_id: str, index: int) -> dict[str, Any] | None:
        """Episode `index`'s token view (rollout_wire.tokens: prompt/response ids, mask and
        log-probabilities, or why it has none), made once when the episode was collected.
        None before the episode is collected."""
        trajectory = self.trajectory(batch_id, index)
        if trajectory is None:
            return None
        view: dict[str, Any] = trajectory.get("tokens") or token_view(trajectory["steps"])
        return view

    def sampled_groups(
        self, batch_id: str, timeout: float | None = None
    ) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """(group, its samples) as each group completes: every sample's row (reward, status,
        `failure_kind`: an `infrastructure` one is no sample) and its token view under
        `tokens` (None for an episode that never ran), in sample order. What trainer
        adapters consume."""
        for group in self.groups(batch_id, timeout):
            indexes = [str(i) for i in group["indexes"]]
            what = f"reading the samples of group {group['group_id']} of batch {batch_id}"
            rows, stored = self.call(
                what,
                lambda indexes=indexes: (  # type: ignore[misc]
                    self.redis.hmget(k.episodes_key(batch_id), indexes),
                    self.redis.hmget(k.trajectories_key(batch_id), indexes),
                ),
            )
            samples = []
            for raw_row, raw_trajectory in zip(rows, stored, strict=True):
                if raw_row is None:
                    continue
                row: dict[str, Any] = codec.loads(raw_row)
                trajectory = codec.loads(raw_trajectory) if raw_trajectory is not None else None
                row["tokens"] = (trajectory or {}).get("tokens")
                samples.append(row)
            yield group, sorted(samples, key=lambda r: r.get("sample", 0))

    def records(self, batch_id: str) -> dict[str, str]:
        raw = self.call(
            f"reading the records of batch {batch_id}",
            lambda: self.redis.hgetall(k.artifacts_key(batch_id)),
        )
        return codec.decode_text_hash(raw)

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


def _password(url: str) -> str | None:
    try:
        return urllib.parse.urlsplit(url).password
    except ValueError:
        return None

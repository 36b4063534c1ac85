"""What every lifecycle step shares: the store it needs (a protocol), the receipt, the limits
read from the settings once, and the flags a batch carries."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_wire.request import BatchSpec
from rollout_wire.rows import EpisodeRow
from rollout_wire.states import Cleanup, Records
from rollout_worker.backends.base import Backend, RunHandle
from rollout_worker.settings import Settings
from rollout_worker.store import GroupPublished, WakerLook

# The watchdog looks at a batch at least this often, and gives the chord this long after the
# collectors' own give-up time before it finalises the batch itself.
# Well under the visibility timeout: a delayed message held longer is restored by kombu even
# though its worker lives, and the copies would double at every step.
WATCHDOG_STEP_SECONDS = 10.0
# ... and this often while every episode without a row is parked: the waker holds them all (the
# watchdog has just renewed it if it died), so no collector has one to lose. A long batch's
# watchdog then costs a third of its steps (each a task run and a message).
WATCHDOG_QUIET_STEP_SECONDS = 30.0
# The watchdog's rescue starts no sooner than this after a run started, whatever the
# visibility timeout (a shorter one in tests would let it race live collectors).
RESCUE_AFTER_MIN_SECONDS = 45.0

BackendFor = Callable[[str], Backend]


class BatchStore(Protocol):
    """What the lifecycle needs from storage (`store.Store` on Redis; a dict in unit tests)."""

    def create_receipt(self, batch_id: str, fields: Mapping[str, Any]) -> bool: ...
    def update_receipt(self, batch_id: str, fields: Mapping[str, Any]) -> None: ...
    def load_receipt(self, batch_id: str) -> dict[str, Any] | None: ...
    def record_episode(self, batch_id: str, row: EpisodeRow, log: str) -> bool: ...
    def record_trajectory(
        self, batch_id: str, index: int, trajectory: Mapping[str, Any]
    ) -> bool: ...
    def has_episode(self, batch_id: str, index: int) -> bool: ...
    def count_episodes(self, batch_id: str) -> int: ...
    def claim_dispatch(self, batch_id: str, token: str, ttl: float) -> bool: ...
    def drop_dispatch(self, batch_id: str, token: str) -> None: ...
    def recorded(self, batch_id: str) -> set[int]: ...
    def wait_reachable(self, seconds: float) -> bool: ...
    def episode_rows(self, batch_id: str) -> list[EpisodeRow]: ...
    def publish_state(self, batch_id: str, index: int, state: str) -> bool: ...
    def save_records(self, batch_id: str, records: Mapping[str, str]) -> None: ...
    def publish_report(self, batch_id: str, report: Mapping[str, Any]) -> bool: ...
    def has_report(self, batch_id: str) -> bool: ...
    def set_flag(self, batch_id: str, name: str) -> None: ...
    def has_flag(self, batch_id: str, name: str) -> bool: ...
    def register_run(self, batch_id: str, fields: Mapping[str, Any]) -> None: ...
    def registered_runs(self) -> dict[str, dict[str, Any]]: ...
    def forget_run(self, batch_id: str) -> None: ...
    def report(self, batch_id: str) -> dict[str, Any] | None: ...
    def register_pool(self, key: str, fields: Mapping[str, Any]) -> None: ...
    def registered_pools(self) -> dict[str, dict[str, Any]]: ...
    def forget_pool(self, key: str) -> None: ...
    def note_outcome(self, batch_id: str, failure: Mapping[str, Any] | None) -> list[Any]: ...
    def rows_of(self, batch_id: str, indexes: Sequence[int]) -> dict[int, EpisodeRow]: ...
    def publish_group(
        self, batch_id: str, group: Mapping[str, Any], passes: bool, wanted: int
    ) -> GroupPublished: ...
    def has_group(self, batch_id: str, group_id: str) -> bool: ...
    def counted_groups(self, batch_id: str) -> list[str]: ...
    def policy_version(self, trainer: str) -> str | None: ...
    def claim_collect(self, batch_id: str, index: int, token: str, ttl: float) -> bool: ...
    def collecting(self, batch_id: str, indexes: Sequence[int]) -> set[int]: ...
    def count_collect_copy(self, batch_id: str) -> None: ...
    def release_collect(self, batch_id: str, index: int, token: str) -> None: ...
    def park(self, batch_id: str, index: int, message: str, until_ready: bool) -> None: ...
    def parked(self, batch_id: str) -> tuple[list[int], set[int]]: ...
    def unpark(self, batch_id: str, index: int) -> str | None: ...
    def claim_waker(self, batch_id: str, token: str, ttl: float) -> bool: ...
    def waker_look(self, batch_id: str, token: str, ttl: float, flag: str) -> WakerLook: ...
    def drop_waker(self, batch_id: str, token: str) -> None: ...


@dataclass(frozen=True)
class Limits:
    """The settings the lifecycle reads (from `Settings`, read once at the worker's start)."""

    max_batch_episodes: int
    collect_grace_seconds: float
    # Both at most half the visibility timeout (see WATCHDOG_STEP_SECONDS).
    watchdog_step_seconds: float = WATCHDOG_STEP_SECONDS
    watchdog_quiet_step_seconds: float = WATCHDOG_QUIET_STEP_SECONDS
    # After this long a collect task that has not recorded its episode may be lost for good
    # (a worker killed between taking a message and marking it unacknowledged): the watchdog
    # then collects ended episodes itself (workers use their visibility timeout).
    rescue_after_seconds: float = 60.0
    # ROLLOUT_POD_CREATE_RATE: a Kubernetes batch that cannot be created within its deadline
    # at this rate is refused (0: not checked).
    pod_create_rate: float = 0.0
    # How long one collect task waits for its episode before it requeues itself.
    collect_block_seconds: float = 15.0
    # A collecting claim lasts one visibility timeout: a killed holder's claim has expired by
    # the time its message is delivered again.
    claim_seconds: float = 3600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_batch_episodes=settings.max_batch_episodes,
            collect_grace_seconds=settings.collect_grace_seconds,
            watchdog_step_seconds=min(WATCHDOG_STEP_SECONDS, settings.visibility_timeout / 2),
            watchdog_quiet_step_seconds=min(
                WATCHDOG_QUIET_STEP_SECONDS, settings.visibility_timeout / 2
            ),
            rescue_after_seconds=max(RESCUE_AFTER_MIN_SECONDS, float(settings.visibility_timeout)),
            pod_create_rate=settings.pod_create_rate,
            collect_block_seconds=settings.collect_block_seconds,
            claim_seconds=float(settings.visibility_timeout),
        )


# Flags a batch carries in Redis (set once, never cleared).
FLAG_CHORD = "chord"  # the collection chord was sent
FLAG_CANCEL = "cancel"
FLAG_STOPPED = "cancel-stopped"  # the backend stopped the run's sandboxes (or gave up trying)
FLAG_HALT = "halt"  # the circuit breaker tripped: the batch stops (through a cancel)
FLAG_QUOTA = "quota"  # groups_wanted groups passed: the rest is aborted (through a cancel)


class NotYet(Exception):
    """The episode is still running and its batch is within its deadline. `settled`: its
    progress so far is streamed (ready, or the backend streams it itself), so its collector
    may park until it ends; else until it is ready (core/park.py). `stopping`: a cancel is
    under way, look again soon."""

    def __init__(self, settled: bool = False, *, stopping: bool = False) -> None:
        super().__init__("not yet")
        self.settled, self.stopping = settled, stopping


@dataclass(frozen=True)
class Receipt:
    """A batch's receipt in Redis: the request, then the run once it exists."""

    batch_id: str
    spec: BatchSpec
    run: RunHandle | None = None
    warnings: list[str] = field(default_factory=list)
    cleanup: Cleanup | None = None
    records: Records | None = None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Receipt:
        run = fields.get("run")
        return cls(
            batch_id=fields["batch_id"],
            spec=BatchSpec.from_dict(fields["spec"]),
            run=RunHandle.from_dict(run) if isinstance(run, Mapping) else None,
            warnings=list(fields.get("warnings") or []),
            cleanup=Cleanup(fields["cleanup"]) if fields.get("cleanup") else None,
            records=Records(fields["records"]) if fields.get("records") else None,
        )


def load_receipt(store: BatchStore, batch_id: str) -> Receipt | None:
    fields = store.load_receipt(batch_id)
    return Receipt.from_fields(fields) if fields and "spec" in fields else None

"""In-memory stand-ins for the lifecycle's store and backend (`core.BatchStore`, `Backend`),
so the lifecycle's decisions are unit-tested without Redis, Celery or a cluster."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from rollout_wire.constants import STATES
from rollout_wire.errors import BackendError
from rollout_wire.request import BatchSpec
from rollout_wire.rows import EpisodeRow
from rollout_worker.backends.base import FinishedRun, ReceiptUpdate, RunHandle
from rollout_worker.observation import EpisodeObservation
from rollout_worker.store import GroupPublished, WakerLook


class MemoryStore:
    """The same first-writer-wins semantics as the Redis store's Lua scripts."""

    def __init__(self) -> None:
        self.receipts: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, dict[int, EpisodeRow]] = {}
        self.logs: dict[str, dict[int, str]] = {}
        self.states: dict[str, dict[int, str]] = {}
        self.records: dict[str, dict[str, str]] = {}
        self.reports: dict[str, dict[str, Any]] = {}
        self.flags: set[tuple[str, str]] = set()
        self.registry: dict[str, dict[str, Any]] = {}
        self.pools: dict[str, dict[str, Any]] = {}
        self.trajectories: dict[str, dict[int, dict[str, Any]]] = {}
        self.stream: list[tuple[str, str, Any]] = []  # (batch, type, payload)
        self.claims: dict[tuple[str, int], str] = {}  # (batch, index) -> token (never expire)
        self.dispatching: dict[str, str] = {}  # batch -> token of its chord's sender
        self.copies: dict[str, int] = {}
        self.streaks: dict[str, list[Any]] = {}
        self.groups: dict[str, dict[str, dict[str, Any]]] = {}
        self.counted: dict[str, list[str]] = {}
        self.versions: dict[str, str] = {}
        self.parked_messages: dict[str, dict[int, str]] = {}
        self.until_ready: set[tuple[str, int]] = set()
        self.wakers: dict[str, str] = {}  # batch -> the waker lease's token (never expires)

    def rows_of(self, batch_id: str, indexes: Sequence[int]) -> dict[int, EpisodeRow]:
        rows = self.rows.get(batch_id, {})
        return {i: rows[i] for i in indexes if i in rows}

    def publish_group(
        self, batch_id: str, group: Mapping[str, Any], passes: bool, wanted: int
    ) -> GroupPublished:
        # Like the store's script: once per group; the first `wanted` passing ones count.
        groups = self.groups.setdefault(batch_id, {})
        if group["group_id"] in groups:
            return GroupPublished(False, False, False)
        groups[group["group_id"]] = json.loads(json.dumps(dict(group)))
        counted = self.counted.setdefault(batch_id, [])
        count = passes and wanted > 0 and len(counted) < wanted
        if count:
            counted.append(group["group_id"])
        self.stream.append((batch_id, "group", (group["group_id"], count)))
        return GroupPublished(True, count, count and len(counted) == wanted)

    def has_group(self, batch_id: str, group_id: str) -> bool:
        return group_id in self.groups.get(batch_id, {})

    def counted_groups(self, batch_id: str) -> list[str]:
        return list(self.counted.get(batch_id, []))

    def policy_version(self, trainer: str) -> str | None:
        return self.versions.get(trainer)

    def note_outcome(self, batch_id: str, failure: Mapping[str, Any] | None) -> list[Any]:
        streak = self.streaks.setdefault(batch_id, [])
        if failure is None:
            streak.clear()
        else:
            streak.append(dict(failure))
        return list(streak)

    def claim_dispatch(self, batch_id: str, token: str, ttl: float) -> bool:
        return self.dispatching.setdefault(batch_id, token) == token

    def drop_dispatch(self, batch_id: str, token: str) -> None:
        if self.dispatching.get(batch_id) == token:
            del self.dispatching[batch_id]

    def claim_collect(self, batch_id: str, index: int, token: str, ttl: float) -> bool:
        return self.claims.setdefault((batch_id, index), token) == token

    def collecting(self, batch_id: str, indexes: Sequence[int]) -> set[int]:
        return {i for i in indexes if (batch_id, i) in self.claims}

    def count_collect_copy(self, batch_id: str) -> None:
        self.copies[batch_id] = self.copies.get(batch_id, 0) + 1

    def release_collect(self, batch_id: str, index: int, token: str) -> None:
        if self.claims.get((batch_id, index)) == token:
            del self.claims[(batch_id, index)]

    def park(self, batch_id: str, index: int, message: str, until_ready: bool) -> None:
        self.parked_messages.setdefault(batch_id, {})[index] = message
        (self.until_ready.add if until_ready else self.until_ready.discard)((batch_id, index))

    def parked(self, batch_id: str) -> tuple[list[int], set[int]]:
        ready = {i for b, i in self.until_ready if b == batch_id}
        return sorted(self.parked_messages.get(batch_id, {})), ready

    def unpark(self, batch_id: str, index: int) -> str | None:
        self.until_ready.discard((batch_id, index))
        return self.parked_messages.get(batch_id, {}).pop(index, None)

    def claim_waker(self, batch_id: str, token: str, ttl: float) -> bool:
        return self.wakers.setdefault(batch_id, token) == token

    def waker_look(self, batch_id: str, token: str, ttl: float, flag: str) -> WakerLook:
        if not self.claim_waker(batch_id, token, ttl):
            return WakerLook(held=False)
        parked, until_ready = self.parked(batch_id)
        return WakerLook(
            held=True,
            parked=parked,
            until_ready=frozenset(until_ready),
            reported=self.has_report(batch_id),
            cancelled=self.has_flag(batch_id, flag),
        )

    def drop_waker(self, batch_id: str, token: str) -> None:
        if self.wakers.get(batch_id) == token:
            del self.wakers[batch_id]

    def create_receipt(self, batch_id: str, fields: Mapping[str, Any]) -> bool:
        if batch_id in self.receipts:
            return False
        self.receipts[batch_id] = json.loads(json.dumps(dict(fields)))
        return True

    def update_receipt(self, batch_id: str, fields: Mapping[str, Any]) -> None:
        self.receipts.setdefault(batch_id, {}).update(json.loads(json.dumps(dict(fields))))

    def load_receipt(self, batch_id: str) -> dict[str, Any] | None:
        return self.receipts.get(batch_id)

    def record_episode(self, batch_id: str, row: EpisodeRow, log: str) -> bool:
        rows = self.rows.setdefault(batch_id, {})
        if row.index in rows:
            return False
        rows[row.index] = row
        self.logs.setdefault(batch_id, {})[row.index] = log
        self.stream.append((batch_id, "episode", row.index))
        return True

    def record_trajectory(self, batch_id: str, index: int, trajectory: Mapping[str, Any]) -> bool:
        steps = self.trajectories.setdefault(batch_id, {})
        if index in steps:
            return False
        steps[index] = dict(trajectory)
        return True

    def wait_reachable(self, seconds: float) -> bool:
        return True

    def count_episodes(self, batch_id: str) -> int:
        return len(self.rows.get(batch_id, {}))

    def has_episode(self, batch_id: str, index: int) -> bool:
        return index in self.rows.get(batch_id, {})

    def recorded(self, batch_id: str) -> set[int]:
        return set(self.rows.get(batch_id, {}))

    def episode_rows(self, batch_id: str) -> list[EpisodeRow]:
        return list(self.rows.get(batch_id, {}).values())

    def publish_state(self, batch_id: str, index: int, state: str) -> bool:
        # Like the store's script: a state is published once, and never after a later one.
        old = self.states.setdefault(batch_id, {}).get(index)
        if old is not None and STATES.index(state) <= STATES.index(old):
            return False
        self.states[batch_id][index] = state
        self.stream.append((batch_id, "state", (index, state)))
        return True

    def save_records(self, batch_id: str, records: Mapping[str, str]) -> None:
        self.records.setdefault(batch_id, {}).update(records)

    def publish_report(self, batch_id: str, report: Mapping[str, Any]) -> bool:
        if batch_id in self.reports:
            return False
        self.reports[batch_id] = dict(report)
        self.stream.append((batch_id, "report", report.get("status")))
        return True

    def has_report(self, batch_id: str) -> bool:
        return batch_id in self.reports

    def set_flag(self, batch_id: str, name: str) -> None:
        self.flags.add((batch_id, name))

    def has_flag(self, batch_id: str, name: str) -> bool:
        return (batch_id, name) in self.flags

    def register_run(self, batch_id: str, fields: Mapping[str, Any]) -> None:
        self.registry[batch_id] = self.registry.get(batch_id, {}) | json.loads(json.dumps(fields))

    def registered_runs(self) -> dict[str, dict[str, Any]]:
        return dict(self.registry)

    def forget_run(self, batch_id: str) -> None:
        self.registry.pop(batch_id, None)

    def register_pool(self, key: str, fields: Mapping[str, Any]) -> None:
        self.pools[key] = self.pools.get(key, {}) | json.loads(json.dumps(fields))

    def registered_pools(self) -> dict[str, dict[str, Any]]:
        return dict(self.pools)

    def forget_pool(self, key: str) -> None:
        self.pools.pop(key, None)

    def report(self, batch_id: str) -> dict[str, Any] | None:
        return self.reports.get(batch_id)


def good_log(episode_id: str, at: float) -> str:
    ready = {"event": "ready", "at": at, "episode_id": episode_id}
    reward = {
        "event": "reward",
        "at": at + 0.5,
        "episode_id": episode_id,
        "reward": 1,
        "baseline_exit": 1,
        "tests_exit": 0,
        "tests_output": "OK",
    }
    return f"{json.dumps(ready)}\n{json.dumps(reward)}\n"


@dataclass
class StubBackend:
    """Episodes whose fate the test sets: `ended[index]` = (phase, log) once it has ended."""

    origin: float = 1000.0
    name: str = "stub"
    streams_progress: bool = False
    ended: dict[int, tuple[str, str]] = field(default_factory=dict)
    created: int = 0
    deleted: int = 0
    cancelled: int = 0
    resumed: int = 0  # resume_run calls (a controller revived after a wait)
    seen: list[str] = field(default_factory=list)  # batch ids list_runs finds
    deleting_for: int = 0  # delete_run answers "still deleting" this many times
    fail_start: BackendError | None = None
    verdict: str = "Complete"
    ready: set[int] = field(default_factory=set)  # running episodes whose sandbox said ready
    finished_at: dict[int, float] = field(default_factory=dict)  # default: origin + 2
    unseen: set[int] = field(default_factory=set)  # ended, but a watch misses it (no Pod)
    observed: list[int] = field(default_factory=list)  # each wait_episode's index
    fail_finish: list[BackendError] = field(default_factory=list)  # finish_run raises these first

    def preflight(self, spec: BatchSpec) -> list[str]:
        return []

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> RunHandle:
        if self.fail_start is not None:
            raise self.fail_start
        record({"namespace": f"ns-{spec.batch_id}"})  # the receipt names it before it exists
        self.created += 1
        return RunHandle(
            backend=self.name,
            batch_id=spec.batch_id,
            origin=self.origin,
            episode_prefix=f"ep-{spec.batch_id}",
            context="stub",
        )

    def wait_episode(
        self, handle: RunHandle, index: int, timeout: float, *, until_ready: bool = False
    ) -> EpisodeObservation:
        self.observed.append(index)
        episode_id = handle.episode_id(index)
        if index not in self.ended:
            return EpisodeObservation(index, episode_id, "Running", ready=index in self.ready)
        phase, _ = self.ended[index]
        return EpisodeObservation(
            index,
            episode_id,
            phase,
            created_at=self.origin + 0.1,
            finished_at=self.finished_at.get(index, self.origin + 2),
            exit_code=0 if phase == "Succeeded" else 1,
        )

    def wait_ended(
        self, handle: RunHandle, indexes: list[int], timeout: float, *, ready: AbstractSet[int]
    ) -> list[int]:
        return [
            i
            for i in indexes
            if (i in self.ended and i not in self.unseen) or (i in ready and i in self.ready)
        ]

    def resume_run(self, handle: RunHandle) -> None:
        self.resumed += 1

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        return self.ended[obs.index][1]

    def run_status(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        return FinishedRun({}, self.origin + 3, self.verdict)

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        if self.fail_finish:
            raise self.fail_finish.pop(0)
        return FinishedRun({"run.json": "{}"}, self.origin + 3, self.verdict)

    def cancel_run(self, handle: RunHandle) -> None:
        self.cancelled += 1

    def list_runs(self) -> list[str]:
        return list(self.seen)

    def delete_run(self, handle: RunHandle) -> bool:
        self.deleted += 1
        if self.deleting_for > 0:
            self.deleting_for -= 1
            return False
        return True

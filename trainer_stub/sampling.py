"""Continuous sampling: complete groups as they come, never a round waiting for its slowest
episode. `groups_in_flight` groups are kept running: each group that completes makes room for
a new one, submitted in a batch of its own (once `refill_at` groups have completed, so batches
stay a few groups large). Each batch records the policy version it was submitted under.

Used through `RolloutClient.sample`; `Following` is the set of batches a reader follows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_wire import constants as k
from rollout_wire.errors import SamplingStopped
from rollout_wire.rows import group_passes
from rollout_wire.states import BatchStatus, GroupFilter


class Sent(Protocol):
    """What sending a batch returns (`client.Submission`)."""

    @property
    def batch_id(self) -> str: ...
    @property
    def spec(self) -> Any: ...


class SamplingClient(Protocol):
    """What the sampler needs of the trainer's client (`client.RolloutClient`)."""

    def submit(self, **request: Any) -> Sent: ...
    def follow(self, following: Following, timeout: float | None = None) -> Iterator[Any]: ...
    def report(self, batch_id: str) -> dict[str, Any] | None: ...
    def cancel(self, batch_id: str) -> None: ...


# What the sampler decides for every batch it submits.
OWNED_FIELDS = ("tasks", "samples_per_task", "batch_id", "count", "groups_wanted", "group_filter")
# A batch that ends like this never ran: sampling on would only repeat it.
NEVER_RAN = (BatchStatus.REJECTED, BatchStatus.ERROR)


@dataclass
class Following:
    """The batches a reader follows: their stream cursors, until each has its report."""

    batch_ids: list[str] = field(default_factory=list)
    cursors: dict[str, str] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    # Per stream, the rows and groups already given (`Entry.once`): none is given twice.
    given: dict[str, set[tuple[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for batch_id in self.batch_ids:
            self.add(batch_id)

    def add(self, batch_id: str) -> None:
        stream = k.stream_key(batch_id)
        self.cursors.setdefault(stream, "0-0")
        self.names[stream] = batch_id

    def waiting(self) -> list[str]:
        return sorted(self.names[s] for s in self.cursors)


class ContinuousSampler:
    """Groups that pass `group_filter` (complete; `varied`: two distinct rewards at least), as
    they complete, until `total_groups` were given (None: until the iterator is closed).
    Closing the iterator (or an error) cancels every batch still running."""

    def __init__(
        self,
        client: SamplingClient,
        tasks: Sequence[Mapping[str, Any]],
        samples_per_task: int,
        *,
        groups_in_flight: int,
        total_groups: int | None = None,
        group_filter: str = GroupFilter.ANY,
        refill_at: int | None = None,
        request: Mapping[str, Any] | None = None,
    ) -> None:
        request = dict(request or {})
        problems = []
        if not tasks:
            problems.append("tasks must not be empty")
        if groups_in_flight < 1:
            problems.append(f"groups_in_flight must be at least 1, got {groups_in_flight}")
        if total_groups is not None and total_groups < 1:
            problems.append(f"total_groups must be at least 1 (or None), got {total_groups}")
        refill = max(1, groups_in_flight // 4) if refill_at is None else refill_at
        if not 1 <= refill <= max(1, groups_in_flight):
            problems.append(f"refill_at must be within 1..groups_in_flight, got {refill}")
        if group_filter not in tuple(GroupFilter):
            problems.append(f"group_filter {group_filter!r} is not one of {list(GroupFilter)}")
        owned = sorted(set(request) & set(OWNED_FIELDS))
        if owned:
            problems.append(f"the sampler sets {owned} itself")
        if problems:
            raise ValueError("; ".join(problems))
        self.client = client
        self.tasks = [dict(t) for t in tasks]
        self.samples_per_task = samples_per_task
        self.groups_in_flight = groups_in_flight
        self.total_groups = total_groups
        self.group_filter = group_filter
        self.refill_at = refill
        self.request = request
        self.following = Following()
        self.in_flight: dict[str, int] = {}  # batch id -> its groups not complete yet
        self.versions: dict[str, str | None] = {}  # batch id -> the version it was sent under
        self.next_task = 0
        self.batches = 0

    def _submit(self, groups: int) -> None:
        """`groups` new groups, cycling through the tasks; a batch holds each task once."""
        while groups > 0:
            take = min(groups, len(self.tasks))
            chunk = [self.tasks[(self.next_task + i) % len(self.tasks)] for i in range(take)]
            self.next_task = (self.next_task + take) % len(self.tasks)
            submission = self.client.submit(
                **self.request, tasks=chunk, samples_per_task=self.samples_per_task
            )
            self.following.add(submission.batch_id)
            self.in_flight[submission.batch_id] = take
            self.versions[submission.batch_id] = submission.spec.policy_version
            self.batches += 1
            groups -= take

    def groups(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        given = freed = 0
        try:
            self._submit(self.groups_in_flight)
            for batch_id, entry in self.client.follow(self.following, timeout):
                if entry.type == k.ENTRY_GROUP and entry.group is not None:
                    self.in_flight[batch_id] -= 1
                    freed += 1
                    if group_passes(entry.group, self.group_filter):
                        given += 1
                        yield entry.group | {
                            "batch_id": batch_id,
                            "batch_policy_version": self.versions.get(batch_id),
                        }
                        if self.total_groups is not None and given >= self.total_groups:
                            return
                elif entry.type == k.ENTRY_REPORT:
                    if entry.status in NEVER_RAN:
                        report = self.client.report(batch_id) or {}
                        raise SamplingStopped(
                            f"batch {batch_id} ended {entry.status}: "
                            f"{'; '.join(report.get('errors') or [])[:500]}"
                        )
                    freed += self.in_flight.pop(batch_id, 0)  # groups it never streamed
                if freed >= self.refill_at:
                    # Always N in flight, even near the end: capping at "what is still
                    # needed" would wait on the slow groups again. What is running when the
                    # last group is given is cancelled (over-sampling of at most N groups).
                    self._submit(freed)
                    freed = 0
        finally:
            for batch_id in self.following.waiting():
                self.client.cancel(batch_id)

"""Continuous sampling's decisions (`trainer_stub.sampling`), against a scripted client: how
many groups are kept in flight, what is given, what is cancelled when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from rollout_wire import constants as k
from rollout_wire.codec import Entry
from rollout_wire.errors import SamplingStopped
from trainer_stub.sampling import ContinuousSampler

TASKS = [{"id": name} for name in ("a", "b", "c")]


@dataclass
class Spec:
    batch_id: str
    policy_version: str | None = "7"


@dataclass
class Sent:
    spec: Spec

    @property
    def batch_id(self) -> str:
        return self.spec.batch_id


@dataclass
class ScriptedClient:
    """Each batch's groups complete in the order batches were sent; `statuses` per group id
    (default complete); `never_runs` batches end `rejected` without a group."""

    statuses: dict[str, str] = field(default_factory=dict)
    never_runs: set[int] = field(default_factory=set)
    sent: list[dict[str, Any]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def submit(self, **request: Any) -> Sent:
        self.sent.append(request)
        return Sent(Spec(f"b{len(self.sent) - 1}"))

    def follow(self, following: Any, timeout: float | None = None):  # type: ignore[no-untyped-def]
        done = 0
        while following.cursors:
            batch_id = f"b{done}"
            stream = k.stream_key(batch_id)
            if stream in following.cursors:
                if done not in self.never_runs:
                    for task in self.sent[done]["tasks"]:
                        group_id = f"{batch_id}:{task['id']}"
                        status = self.statuses.get(group_id, "complete")
                        yield (
                            batch_id,
                            Entry(
                                k.ENTRY_GROUP,
                                group={"group_id": group_id, "status": status, "varied": False},
                            ),
                        )
                status = "rejected" if done in self.never_runs else "succeeded"
                del following.cursors[stream]
                yield batch_id, Entry(k.ENTRY_REPORT, status=status)
            done += 1

    def report(self, batch_id: str) -> dict[str, Any]:
        return {"errors": ["tasks need a policy"]}

    def cancel(self, batch_id: str) -> None:
        self.cancelled.append(batch_id)


def test_groups_in_flight_are_topped_up_as_groups_complete_and_the_rest_cancelled():
    client = ScriptedClient()
    sampler = ContinuousSampler(client, TASKS, 2, groups_in_flight=3, total_groups=5)
    given = list(sampler.groups())
    assert len(given) == 5 and [g["batch_id"] for g in given[:3]] == ["b0"] * 3
    assert all(g["batch_policy_version"] == "7" for g in given)
    # First 3 groups; then one new group per completed group, never more than needed.
    sizes = [len(r["tasks"]) for r in client.sent]
    assert sizes[0] == 3 and sum(sizes) <= 5 + 3
    assert all(r["samples_per_task"] == 2 for r in client.sent)
    # What was still running when the fifth group came is cancelled.
    assert client.cancelled and set(client.cancelled) <= {f"b{i}" for i in range(len(sizes))}


def test_groups_that_fail_the_filter_are_not_given_but_free_their_place():
    client = ScriptedClient(statuses={"b0:a": "failed"})
    given = list(ContinuousSampler(client, TASKS, 1, groups_in_flight=3, total_groups=3).groups())
    assert [g["group_id"] for g in given][:2] == ["b0:b", "b0:c"] and len(given) == 3


def test_a_batch_that_never_ran_stops_sampling_with_its_reason():
    client = ScriptedClient(never_runs={0})
    with pytest.raises(SamplingStopped, match="rejected: tasks need a policy"):
        list(ContinuousSampler(client, TASKS, 1, groups_in_flight=2).groups())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"groups_in_flight": 0}, "groups_in_flight"),
        ({"groups_in_flight": 2, "total_groups": 0}, "total_groups"),
        ({"groups_in_flight": 2, "group_filter": "best"}, "group_filter"),
        ({"groups_in_flight": 2, "request": {"groups_wanted": 1}}, "sets"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(kwargs, message):
    client = ScriptedClient()
    with pytest.raises(ValueError, match=message):
        ContinuousSampler(client, TASKS, 1, **kwargs)
    assert client.sent == []

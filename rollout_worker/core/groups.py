"""Groups as they finish, and the quota: a group's entry is streamed once, the moment its last
sample has its row; the first `groups_wanted` groups that pass the batch's filter are counted,
and the one that completes the quota ends the batch (the rest is aborted, as a cancel stops
it, and recorded `aborted`)."""

from __future__ import annotations

from rollout_wire.request import BatchSpec
from rollout_wire.rows import group_passes
from rollout_worker.core.state import FLAG_CANCEL, BatchStore
from rollout_worker.report import group_figures, group_starts
from rollout_worker.store import GroupPublished


def publish_group_of(store: BatchStore, spec: BatchSpec, index: int) -> GroupPublished | None:
    """Stream episode `index`'s group if all its samples have their row (any status) and it
    was not streamed before. Safe to repeat: the store streams a group once. Batches without
    tasks (the guide's demo: one group of every episode) are reported as one group only."""
    if not spec.tasks:
        return None
    group_id = spec.episode(index).group_id
    if store.has_group(spec.batch_id, group_id):
        return None
    indexes = spec.group_of(index)
    rows = store.rows_of(spec.batch_id, indexes)
    if len(rows) < len(indexes):
        return None
    group = group_figures(spec, indexes, rows)
    return store.publish_group(
        spec.batch_id, group, group_passes(group, spec.group_filter), spec.groups_wanted
    )


def publish_every_group(store: BatchStore, spec: BatchSpec) -> None:
    """Before the report: a group whose last collector died before streaming it is streamed
    now, so every group has its entry ahead of the report's."""
    for start in group_starts(spec):
        publish_group_of(store, spec, start)


def quota_unenforced(store: BatchStore, spec: BatchSpec) -> bool:
    """The batch has its groups but nothing stops the rest: the collector that counted the
    last group died before it sent the stop (the watchdog then sends it)."""
    if not spec.groups_wanted or store.has_flag(spec.batch_id, FLAG_CANCEL):
        return False
    return len(store.counted_groups(spec.batch_id)) >= spec.groups_wanted

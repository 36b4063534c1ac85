"""Collect one episode: wait for it, validate it, record its row once; and the watchdog's rescue
of episodes whose collector was lost. When an episode is given up on."""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout_wire.errors import BackendError, TransientBackendError
from rollout_wire.request import BatchSpec
from rollout_wire.rows import EpisodeRow
from rollout_wire.states import EpisodeStatus, FailureKind, Progress
from rollout_wire.trajectory import trajectory_from_log
from rollout_worker.backends.base import Backend, RunHandle
from rollout_worker.core.state import (
    FLAG_CANCEL,
    FLAG_HALT,
    FLAG_QUOTA,
    FLAG_STOPPED,
    BatchStore,
    Limits,
    NotYet,
    Receipt,
)
from rollout_worker.observation import EpisodeObservation
from rollout_worker.validation import lost_row, validate_episode

# How long the watchdog's rescue waits for its first look at the backend (a watch to sync).
RESCUE_FIRST_BLOCK_SECONDS = 3.0
# The rescue leaves an episode that ended less than this long ago to its own collector: a busy
# collector records it within seconds, and a rescue racing it reads the episode's log twice.
RESCUE_ENDED_SECONDS = 10.0
# The watchdog gives the chord this long after the collectors' own give-up time before it
# finalises the batch itself.
WATCHDOG_EXTRA_SECONDS = 30.0
# What Redis keeps of one episode's log (validation reads all of it, up to the backend's cap).
STORED_LOG_BYTES = 2**20


# -- when to give up -------------------------------------------------------------------------
def give_up_at(spec: BatchSpec, run: RunHandle, limits: Limits) -> float:
    """After this, an episode that has not ended is lost."""
    return run.origin + spec.deadline_seconds + limits.collect_grace_seconds


def watchdog_countdown(
    spec: BatchSpec, run: RunHandle, limits: Limits, now: float, *, quiet: bool = False
) -> float:
    """Seconds until the watchdog should look again: at most a step (a longer one while the
    batch is `quiet`: every episode left is parked), never past its due time."""
    due = give_up_at(spec, run, limits) + WATCHDOG_EXTRA_SECONDS
    step = limits.watchdog_quiet_step_seconds if quiet else limits.watchdog_step_seconds
    return max(0.0, min(step, due - now))


def rescue(
    store: BatchStore, backend: Backend, receipt: Receipt, limits: Limits, now: float
) -> bool:
    """The watchdog's look at a running batch: once its collection could have stalled, record
    every episode that ended a while ago (RESCUE_ENDED_SECONDS) but has no row (first writer
    wins, so a live collector's copy is harmless). True when every episode has its row: the
    batch can be reported now, whether or not the chord's callback ever comes."""
    run = receipt.run
    if run is None or now - run.origin < limits.rescue_after_seconds:
        return False
    batch_id = receipt.spec.batch_id
    # One read of the rows per look, not one per episode: the watchdog looks every few
    # seconds for as long as the batch runs, so this cost grows with the episodes' length.
    recorded = store.recorded(batch_id)
    missing = [i for i in range(receipt.spec.count) if i not in recorded]
    # Only episodes nobody is on: a parked one is its waker's (the watchdog keeps one alive,
    # and it looks fully at each now and then), a claimed one its collector's. Looking at
    # those too kept a watch of every Pod of a long batch in each control process.
    parked = set(store.parked(batch_id)[0]) if missing else set()
    unparked = [i for i in missing if i not in parked]
    taken = store.collecting(batch_id, unparked)
    for position, index in enumerate(i for i in unparked if i not in taken):
        # The first look may wait a little: this process may have no watch of the batch yet,
        # and one that has not listed the Pods yet sees nothing (it would cost a whole step).
        block = RESCUE_FIRST_BLOCK_SECONDS if position == 0 else 0
        try:
            obs: EpisodeObservation | None = backend.wait_episode(run, index, block)
        except TransientBackendError:
            continue
        except BackendError:
            obs = None  # collect records the episode lost, and why
        if obs is not None and (
            not obs.terminal
            or (obs.finished_at is not None and now - obs.finished_at < RESCUE_ENDED_SECONDS)
        ):
            continue
        try:
            collect(
                store,
                backend,
                receipt,
                index,
                block=0,
                final=False,
                limits=limits,
                now=lambda: now,
            )
        except (NotYet, TransientBackendError):
            continue
    return not missing or store.count_episodes(batch_id) == receipt.spec.count


# -- collect ---------------------------------------------------------------------------------
def collect(
    store: BatchStore,
    backend: Backend,
    receipt: Receipt,
    index: int,
    *,
    block: float,
    final: bool,
    limits: Limits,
    now: Callable[[], float] = time.time,
) -> EpisodeRow:
    """Collect episode `index`: validate it if it ended; record it lost when `final` or past
    the give-up time; else raise NotYet. The first row recorded for an index wins."""
    spec, run = receipt.spec, receipt.run
    assert run is not None, "collect needs a started run"

    def in_time() -> bool:
        return not final and now() < give_up_at(spec, run, limits)

    episode_id = run.episode_id(index)
    text = ""
    cancelled = store.has_flag(spec.batch_id, FLAG_CANCEL)
    stopped = cancelled and store.has_flag(spec.batch_id, FLAG_STOPPED)
    try:
        obs = _wait(
            store,
            backend,
            receipt,
            index,
            0 if stopped else min(block, 1.0) if cancelled else block,
        )
        if obs.phase != "Succeeded" and not cancelled:
            # Cancelled while this collector waited: the cancel stopped the sandbox (a Pod
            # killed by the suspended Job ends Failed), so the episode was cancelled, not failed.
            cancelled = store.has_flag(spec.batch_id, FLAG_CANCEL)
        if cancelled and obs.phase != "Succeeded" and (obs.terminal or stopped):
            row = _stopped_row(store, spec, index, obs)
        elif cancelled and not obs.terminal and in_time():
            backend.resume_run(run)
            raise NotYet(stopping=True)  # the report must not come before the stop
        elif obs.terminal:
            text = backend.read_output(run, obs)
            row = stale_or_not(store, spec, validate_episode(obs, text, run.origin))
            if row.reward_at is not None:
                store.publish_state(spec.batch_id, index, Progress.REWARDED)
            if spec.policy is not None:
                # Stored before the row, so a trainer woken by the row finds it.
                store.record_trajectory(spec.batch_id, index, trajectory_from_log(text))
        elif in_time():
            # Not ended after a wait: like a restarted Job controller, revive what runs the
            # episodes if it died (locally, the run's supervisor).
            backend.resume_run(run)
            if obs.phase == "Running":
                store.publish_state(spec.batch_id, index, Progress.RUNNING)
            raise NotYet(settled=obs.ready or backend.streams_progress)
        else:
            row = lost_row(
                index,
                obs.episode_id,
                f"still {obs.phase} {spec.deadline_seconds}s after the run started "
                "(deadline) and the collection grace period",
                obs,
            )
    except TransientBackendError:
        if in_time():
            raise
        row = lost_row(index, episode_id, "the backend kept failing until the deadline", None)
    except BackendError as exc:
        row = lost_row(index, episode_id, str(exc), None)
    if spec.tasks and row.task_id is None:
        # A row the sandbox never spoke for (lost, aborted) still names its task and group.
        assigned = spec.episode(index)
        row.task_id, row.sample, row.group_id = assigned.task_id, assigned.sample, assigned.group_id
    if store.record_episode(spec.batch_id, row, _stored_log(text)):
        _count_for_breaker(store, spec, row)
    return row


def _stopped_row(
    store: BatchStore, spec: BatchSpec, index: int, obs: EpisodeObservation
) -> EpisodeRow:
    """The row of an episode the batch stopped before it succeeded: why it stopped (a halt,
    the quota met, a cancel) decides what the row says."""
    if store.has_flag(spec.batch_id, FLAG_HALT):
        why = "aborted: the batch halted (too many infrastructure failures in a row)"
        return lost_row(index, obs.episode_id, why, obs)
    if store.has_flag(spec.batch_id, FLAG_QUOTA):
        why = f"aborted: the batch had its {spec.groups_wanted} group(s)"
        return withdrawn_row(index, obs.episode_id, EpisodeStatus.ABORTED, why, obs)
    return lost_row(index, obs.episode_id, "cancelled before it finished", obs)


def withdrawn_row(
    index: int,
    episode_id: str,
    status: EpisodeStatus,
    why: str,
    obs: EpisodeObservation | None,
) -> EpisodeRow:
    """An episode the service stopped on purpose (aborted, stale): no failure, no reward."""
    row = lost_row(index, episode_id, why, obs)
    row.status, row.errors, row.failure_kind = status, [], None
    if obs is not None:
        row.finished_at = obs.finished_at
    return row


def stale_or_not(store: BatchStore, spec: BatchSpec, row: EpisodeRow) -> EpisodeRow:
    """The staleness bound, checked when the row is recorded: a sample whose first turn is more
    than `max_policy_lag` versions behind the version its trainer published since is `stale`
    (the runner stops an episode itself when it sees the policy move on; this catches a
    trainer that moved on before the server did). Integer versions only."""
    lag_limit = spec.policy.max_policy_lag if spec.policy is not None else None
    first = (row.policy_versions or {}).get("first")
    if (
        lag_limit is None
        or spec.policy is None
        or first is None
        or row.status.withdrawn
        or row.failure_kind == FailureKind.INFRASTRUCTURE
    ):
        return row
    current = store.policy_version(spec.policy.trainer)
    try:
        lag = int(str(current)) - int(str(first))
    except ValueError:
        return row
    if lag <= lag_limit:
        return row
    why = (
        f"stale: first turn at policy version {first}, the trainer is at {current} "
        f"(max_policy_lag {lag_limit})"
    )
    row.status, row.reward, row.errors = EpisodeStatus.STALE, 0, []
    row.failure_kind, row.failure_cause = None, why
    return row


def tripped_by(store: BatchStore, batch_id: str, index: int) -> bool:
    """Whether episode `index`'s row tripped its batch's circuit breaker (the last failure of
    the streak that halted it): its collector is the one that stops the rest."""
    if not store.has_flag(batch_id, FLAG_HALT):
        return False
    halted = (store.load_receipt(batch_id) or {}).get("halted") or {}
    failures = halted.get("failures") or []
    return bool(failures) and failures[-1].get("index") == index


def _count_for_breaker(store: BatchStore, spec: BatchSpec, row: EpisodeRow) -> None:
    """The circuit breaker: an infrastructure failure extends the batch's streak, any sample
    of the policy (ok, or an episode that broke a rule) ends it; a lost row (deadline,
    cancel) does neither. At the limit the batch is flagged halted, with the failures that
    tripped it in its receipt; the worker then stops the rest (`Worker.collect`)."""
    limit = spec.max_consecutive_infra_failures
    if limit == 0 or row.status == EpisodeStatus.LOST or row.status.withdrawn:
        return
    if row.failure_kind != FailureKind.INFRASTRUCTURE:
        store.note_outcome(spec.batch_id, None)
        return
    streak = store.note_outcome(spec.batch_id, {"index": row.index, "cause": row.failure_cause})
    if len(streak) == limit:  # exactly one collector sees this length
        cause = f"{limit} infrastructure failures in a row (the last: {row.failure_cause})"
        store.update_receipt(spec.batch_id, {"halted": {"cause": cause, "failures": streak}})
        store.set_flag(spec.batch_id, FLAG_HALT)


def _wait(
    store: BatchStore, backend: Backend, receipt: Receipt, index: int, timeout: float
) -> EpisodeObservation:
    """Wait for episode `index` to end; on the way, stream that it runs and is ready (for
    backends whose sandboxes cannot stream it themselves). Each state is published once."""
    assert receipt.run is not None
    batch_id, end = receipt.spec.batch_id, time.monotonic() + timeout
    obs = backend.wait_episode(receipt.run, index, timeout, until_ready=True)
    if obs.ready and not obs.terminal:
        store.publish_state(batch_id, index, Progress.RUNNING)
        store.publish_state(batch_id, index, Progress.READY)
        obs = backend.wait_episode(receipt.run, index, max(0.0, end - time.monotonic()))
    return obs


def _stored_log(text: str) -> str:
    """At most STORED_LOG_BYTES of an episode's log go to Redis, with a visible cut mark."""
    data = text.encode("utf-8", "replace")
    if len(data) <= STORED_LOG_BYTES:
        return text
    kept = data[:STORED_LOG_BYTES].decode("utf-8", "ignore")
    return kept + f"\n[rollout: log stored cut at {STORED_LOG_BYTES} of {len(data)} bytes]\n"


# -- one collecting copy per episode ---------------------------------------------------------
CLAIM_POLL_SECONDS = 0.5


def claim(store: BatchStore, batch_id: str, index: int, token: str, limits: Limits) -> bool:
    """Be the one copy collecting episode `index`. A second copy (a message redelivered while
    the first still runs) waits up to one collect block for the claim or the row instead of
    watching and reading the episode again; it must not return before the row exists either,
    or the chord would count the episode before it is recorded. The claim lasts one
    visibility timeout: a killed holder's claim has expired by the time its message is
    delivered again."""
    if store.claim_collect(batch_id, index, token, limits.claim_seconds):
        return True
    store.count_collect_copy(batch_id)
    end = time.monotonic() + limits.collect_block_seconds
    while time.monotonic() < end and not store.has_episode(batch_id, index):
        time.sleep(CLAIM_POLL_SECONDS)
        if store.claim_collect(batch_id, index, token, limits.claim_seconds):
            return True
    return False

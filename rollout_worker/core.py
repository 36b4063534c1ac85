"""The batch lifecycle without Celery: admit and start a batch, collect one episode, publish the
report, clean the run up, and decide when the watchdog looks again.

Celery tasks (`tasks.py`) call these with the Redis store and real backends; unit tests call
them with an in-memory store and a stub backend. Every function is safe to run again for the
same batch (brokers redeliver): the store's writes are first-writer-wins.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_wire.errors import BackendError, InvalidSpec, TransientBackendError
from rollout_wire.request import BatchSpec, is_batch_id, parse_spec
from rollout_wire.rows import EpisodeRow
from rollout_wire.trajectory import trajectory_from_log
from rollout_worker.backends.base import Backend, FinishedRun, PoolBackend, RunHandle
from rollout_worker.observation import EpisodeObservation
from rollout_worker.quantities import resource_problems
from rollout_worker.report import build_report, error_report
from rollout_worker.schedule import deadline_problem
from rollout_worker.validation import lost_row, validate_episode

log = logging.getLogger(__name__)

# The watchdog looks at a batch at least this often, and gives the chord this long after the
# collectors' own give-up time before it finalises the batch itself.
# Well under the visibility timeout: a delayed message held longer is restored by kombu even
# though its worker lives, and the copies would double at every step.
WATCHDOG_STEP_SECONDS = 10.0
# How long the watchdog's rescue waits for its first look at the backend (a watch to sync).
RESCUE_FIRST_BLOCK_SECONDS = 3.0
# The rescue leaves an episode that ended less than this long ago to its own collector: a busy
# collector records it within seconds, and a rescue racing it reads the episode's log twice.
RESCUE_ENDED_SECONDS = 10.0
WATCHDOG_EXTRA_SECONDS = 30.0
# What Redis keeps of one episode's log (validation reads all of it, up to the backend's cap).
STORED_LOG_BYTES = 2**20
# A deleting run is looked at again after this long (the deletion runs in Kubernetes, not in
# a worker slot).
CLEANUP_RECHECK_SECONDS = 2.0

# Records states, in the report (pending: it is published before them) and the receipt.
RECORDS_PENDING = "pending"
RECORDS_COMPLETE = "complete"
RECORDS_FAILED = "failed"

# Cleanup states, stored in the receipt's `cleanup` field and shown by the report.
CLEANUP_KEPT = "kept"
CLEANUP_SCHEDULED = "scheduled"
CLEANUP_DELETING = "deleting"
CLEANUP_DELETED = "deleted"
CLEANUP_FAILED = "failed"

# A report older than this whose run is still scheduled for deletion is the sweeper's to delete
# (its cleanup task was lost).
SWEEP_STALLED_CLEANUP_SECONDS = 600.0

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


@dataclass(frozen=True)
class Limits:
    """The settings the lifecycle reads (from `Settings`, read once at the worker's start)."""

    max_batch_episodes: int
    collect_grace_seconds: float
    # At most half the visibility timeout (see WATCHDOG_STEP_SECONDS).
    watchdog_step_seconds: float = WATCHDOG_STEP_SECONDS
    # After this long a collect task that has not recorded its episode may be lost for good
    # (a worker killed between taking a message and marking it unacknowledged): the watchdog
    # then collects ended episodes itself (workers use their visibility timeout).
    rescue_after_seconds: float = 60.0
    # ROLLOUT_POD_CREATE_RATE: a Kubernetes batch that cannot be created within its deadline
    # at this rate is refused (0: not checked).
    pod_create_rate: float = 0.0


FLAG_CANCEL = "cancel"
FLAG_STOPPED = "cancel-stopped"  # the backend stopped the run's sandboxes (or gave up trying)


class NotYet(Exception):
    """The episode is still running and its batch is within its deadline."""


@dataclass(frozen=True)
class Receipt:
    """A batch's receipt in Redis: the request, then the run once it exists."""

    batch_id: str
    spec: BatchSpec
    run: RunHandle | None = None
    warnings: list[str] = field(default_factory=list)
    cleanup: str | None = None
    records: str | None = None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> Receipt:
        run = fields.get("run")
        return cls(
            batch_id=fields["batch_id"],
            spec=BatchSpec.from_dict(fields["spec"]),
            run=RunHandle.from_dict(run) if isinstance(run, Mapping) else None,
            warnings=list(fields.get("warnings") or []),
            cleanup=fields.get("cleanup"),
            records=fields.get("records"),
        )


def load_receipt(store: BatchStore, batch_id: str) -> Receipt | None:
    fields = store.load_receipt(batch_id)
    return Receipt.from_fields(fields) if fields and "spec" in fields else None


# -- when to give up -------------------------------------------------------------------------
def give_up_at(spec: BatchSpec, run: RunHandle, limits: Limits) -> float:
    """After this, an episode that has not ended is lost."""
    return run.origin + spec.deadline_seconds + limits.collect_grace_seconds


def watchdog_countdown(spec: BatchSpec, run: RunHandle, limits: Limits, now: float) -> float:
    """Seconds until the watchdog should look again: at most a step, never past its due time."""
    due = give_up_at(spec, run, limits) + WATCHDOG_EXTRA_SECONDS
    return max(0.0, min(limits.watchdog_step_seconds, due - now))


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
    missing = [i for i in range(receipt.spec.count) if not store.has_episode(batch_id, i)]
    for position, index in enumerate(missing):
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
    return all(store.has_episode(batch_id, i) for i in missing)


# -- submit ----------------------------------------------------------------------------------
def admit(request: Mapping[str, Any], max_episodes: int, pod_create_rate: float = 0.0) -> BatchSpec:
    """The worker's edge: the request's own rules, then the resource arithmetic, then whether
    the batch can finish within its deadline at all (rollout_worker/schedule.py)."""
    spec = parse_spec(request, max_episodes=max_episodes)
    problems = resource_problems(spec.resources)
    too_long = deadline_problem(
        spec.count,
        spec.parallelism,
        spec.deadline_seconds,
        backend=spec.backend,
        create_rate=pod_create_rate,
    )
    if too_long:
        problems.append(too_long)
    if problems:
        raise InvalidSpec(problems)
    return spec


@dataclass(frozen=True)
class Submitted:
    """What `submit` did. `dispatch`: the collection chord still has to be sent."""

    batch_id: str | None
    status: str  # started | rejected | conflict | done | error
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    spec: BatchSpec | None = None
    run: RunHandle | None = None
    dispatch: bool = False

    def as_result(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "status": self.status,
            "errors": self.errors,
            "warnings": self.warnings,
        }


def submit(
    store: BatchStore,
    backend_for: BackendFor,
    message: Any,
    *,
    default_batch_id: str | None,
    limits: Limits,
    now: float,
) -> Submitted:
    """Admit a request, write its receipt, start (or adopt) its run.

    A TransientBackendError propagates, for the caller to retry; `fail` ends the batch after.
    """
    if not isinstance(message, Mapping):
        problem = f"a batch request must be a JSON object, got {type(message).__name__}"
        return _reject(store, default_batch_id, [problem], {})
    request = dict(message)
    # A request without an id gets one derived from the message, so a redelivery of the same
    # message maps to the same batch.
    if request.get("batch_id") is None:
        request["batch_id"] = default_batch_id
    request.setdefault("submitted_at", now)
    try:
        spec = admit(request, limits.max_batch_episodes, limits.pod_create_rate)
    except InvalidSpec as exc:
        # An unusable batch id is answered under the message's own id, which the sender knows.
        given = request.get("batch_id")
        return _reject(
            store, given if is_batch_id(given) else default_batch_id, exc.problems, request
        )

    fresh = store.create_receipt(
        spec.batch_id,
        {
            "batch_id": spec.batch_id,
            "spec": spec.to_dict(),
            "backend": spec.backend,
            "received_at": now,
        },
    )
    if fresh:
        # The registry entry outlives the receipt: the sweeper's proof of what was created.
        store.register_run(
            spec.batch_id, {"batch_id": spec.batch_id, "backend": spec.backend, "created_at": now}
        )
    else:
        stored = load_receipt(store, spec.batch_id)
        if stored is None or _comparable(stored.spec) != _comparable(spec):
            log.error("batch id %s reused with a different request; ignored", spec.batch_id)
            return Submitted(spec.batch_id, "conflict", [f"batch id {spec.batch_id} is taken"])
        if store.has_report(spec.batch_id):
            return Submitted(spec.batch_id, "done")
        spec = stored.spec  # keep the first delivery's submitted_at

    backend = backend_for(spec.backend)

    def record(fields: Mapping[str, Any]) -> None:
        store.update_receipt(spec.batch_id, fields)
        store.register_run(spec.batch_id, fields)

    try:
        warnings = backend.preflight(spec)
        run = backend.start_run(spec, record)
    except TransientBackendError:
        raise
    except BackendError as exc:
        return fail(store, spec, [str(exc)])
    store.update_receipt(spec.batch_id, {"run": run.to_dict(), "warnings": warnings})
    store.register_run(spec.batch_id, {"run": run.to_dict()})
    return Submitted(
        spec.batch_id,
        "started",
        warnings=warnings,
        spec=spec,
        run=run,
        dispatch=not store.has_flag(spec.batch_id, "chord"),
    )


def _comparable(spec: BatchSpec) -> dict[str, Any]:
    return {name: value for name, value in spec.to_dict().items() if name != "submitted_at"}


def _reject(
    store: BatchStore, batch_id: Any, problems: list[str], request: Mapping[str, Any]
) -> Submitted:
    # Answer under the batch id only when no batch owns it: a malformed copy of a valid
    # batch's message must never overwrite that batch's outcome.
    if is_batch_id(batch_id) and store.load_receipt(batch_id) is None:
        store.publish_report(batch_id, error_report(batch_id, "rejected", problems, request))
    log.warning("rejected batch %s: %s", batch_id, "; ".join(problems))
    return Submitted(batch_id if is_batch_id(batch_id) else None, "rejected", list(problems))


def fail(store: BatchStore, spec: BatchSpec, errors: list[str]) -> Submitted:
    """End a batch whose run could not start: its report says why."""
    store.publish_report(
        spec.batch_id, error_report(spec.batch_id, "error", errors, spec.to_dict())
    )
    return Submitted(spec.batch_id, "error", list(errors), spec=spec)


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
            row = lost_row(index, obs.episode_id, "cancelled before it finished", obs)
        elif cancelled and not obs.terminal and in_time():
            raise NotYet  # the stop is under way: the report must not come before it
        elif obs.terminal:
            text = backend.read_output(run, obs)
            row = validate_episode(obs, text, run.origin)
            if row.reward_at is not None:
                store.publish_state(spec.batch_id, index, "rewarded")
            if spec.policy is not None:
                # Stored before the row, so a trainer woken by the row finds it.
                store.record_trajectory(spec.batch_id, index, trajectory_from_log(text))
        elif in_time():
            if obs.phase == "Running":
                store.publish_state(spec.batch_id, index, "running")
            raise NotYet
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
    store.record_episode(spec.batch_id, row, _stored_log(text))
    return row


def _wait(
    store: BatchStore, backend: Backend, receipt: Receipt, index: int, timeout: float
) -> EpisodeObservation:
    """Wait for episode `index` to end; on the way, stream that it runs and is ready (for
    backends whose sandboxes cannot stream it themselves). Each state is published once."""
    assert receipt.run is not None
    batch_id, end = receipt.spec.batch_id, time.monotonic() + timeout
    obs = backend.wait_episode(receipt.run, index, timeout, until_ready=True)
    if obs.ready and not obs.terminal:
        store.publish_state(batch_id, index, "running")
        store.publish_state(batch_id, index, "ready")
        obs = backend.wait_episode(receipt.run, index, max(0.0, end - time.monotonic()))
    return obs


def _stored_log(text: str) -> str:
    """At most STORED_LOG_BYTES of an episode's log go to Redis, with a visible cut mark."""
    data = text.encode("utf-8", "replace")
    if len(data) <= STORED_LOG_BYTES:
        return text
    kept = data[:STORED_LOG_BYTES].decode("utf-8", "ignore")
    return kept + f"\n[rollout: log stored cut at {STORED_LOG_BYTES} of {len(data)} bytes]\n"


# -- report ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finalized:
    report: dict[str, Any]
    cleanup: str  # CLEANUP_SCHEDULED (the caller schedules `cleanup`) or CLEANUP_KEPT


def finalize(
    store: BatchStore,
    backend_for: BackendFor,
    batch_id: str,
    *,
    finalized_by: str,
    limits: Limits,
    now: Callable[[], float] = time.time,
) -> Finalized | None:
    """Publish the report once, as soon as the episodes are in; then save the run's records
    (which may wait for the backend to settle). Returns None when the report was published
    before (a redelivered callback then only completes the records, if they are missing).

    The watchdog (finalized_by="watchdog") first collects what the backend still has and
    records every other episode as lost.
    """
    receipt = load_receipt(store, batch_id)
    if receipt is None or receipt.run is None:
        log.error("cannot finalize %s: no receipt with a run", batch_id)
        return None
    spec, run = receipt.spec, receipt.run
    backend = backend_for(run.backend)
    done: Finalized | None = None
    if not store.has_report(batch_id):
        if finalized_by == "watchdog":
            for index in range(spec.count):
                if not store.has_episode(batch_id, index):
                    collect(store, backend, receipt, index, block=0, final=True, limits=limits)
        done = _publish(store, backend, receipt, finalized_by, now())
    if receipt.records != RECORDS_COMPLETE:
        _save_records(store, backend, receipt)
    return done


def _publish(
    store: BatchStore, backend: Backend, receipt: Receipt, finalized_by: str, now: float
) -> Finalized | None:
    spec, run = receipt.spec, receipt.run
    assert run is not None
    status: FinishedRun | None = None
    batch_errors: list[str] = []
    try:
        status = backend.run_status(spec, run)
    except BackendError as exc:
        batch_errors.append(f"could not read how the run ended: {exc}")
    cleanup = CLEANUP_KEPT if spec.keep_run else CLEANUP_SCHEDULED
    report = build_report(
        spec,
        store.episode_rows(spec.batch_id),
        run,
        status,
        finalized_by=finalized_by,
        reported_at=now,
        warnings=receipt.warnings,
        batch_errors=batch_errors,
    ) | {"cleanup": cleanup, "records": RECORDS_PENDING}
    if store.has_flag(spec.batch_id, FLAG_CANCEL):
        report |= {"ok": False, "status": "cancelled"}
    if not store.publish_report(spec.batch_id, report):
        return None
    store.update_receipt(spec.batch_id, {"cleanup": cleanup})
    return Finalized(report, cleanup)


def _save_records(store: BatchStore, backend: Backend, receipt: Receipt) -> None:
    """The run's records (job.json, pods.json, events, logs of the supervisor...), after the
    report: the receipt's `records` says when they are complete."""
    assert receipt.run is not None
    try:
        finished = backend.finish_run(receipt.spec, receipt.run)
    except BackendError as exc:
        store.update_receipt(
            receipt.batch_id, {"records": RECORDS_FAILED, "records_error": str(exc)}
        )
        return
    store.save_records(receipt.batch_id, finished.records)
    store.update_receipt(
        receipt.batch_id,
        {
            "records": RECORDS_COMPLETE,
            "run_verdict": finished.verdict,
            "completed_at": finished.completed_at,
        },
    )


# -- cleanup ---------------------------------------------------------------------------------
def cleanup_pending(store: BatchStore, batch_id: str) -> bool:
    """The report asked for the run's deletion and it has not ended: a redelivered callback or
    watchdog schedules the cleanup again (the first one may have died before sending it)."""
    report = store.report(batch_id)
    if report is None or report.get("cleanup") != CLEANUP_SCHEDULED:
        return False
    receipt = load_receipt(store, batch_id)
    return receipt is not None and receipt.cleanup in (None, CLEANUP_SCHEDULED, CLEANUP_DELETING)


def cleanup(store: BatchStore, backend_for: BackendFor, batch_id: str) -> str:
    """Delete a reported batch's run (ownership-checked by the backend). Returns the cleanup
    state: CLEANUP_DELETING means "look again later" (the deletion runs in the backend)."""
    receipt = load_receipt(store, batch_id)
    if receipt is None or receipt.run is None:
        return CLEANUP_DELETED  # nothing was created, or the receipt expired with its run
    if receipt.cleanup in (CLEANUP_DELETED, CLEANUP_KEPT, CLEANUP_FAILED):
        return receipt.cleanup
    try:
        gone = backend_for(receipt.run.backend).delete_run(receipt.run)
    except TransientBackendError:
        raise
    except BackendError as exc:
        log.error("batch %s: run not deleted: %s", batch_id, exc)
        store.update_receipt(batch_id, {"cleanup": CLEANUP_FAILED, "cleanup_error": str(exc)})
        return CLEANUP_FAILED
    state = CLEANUP_DELETED if gone else CLEANUP_DELETING
    store.update_receipt(batch_id, {"cleanup": state})
    if gone:
        store.forget_run(batch_id)
    return state


# -- cancel ----------------------------------------------------------------------------------
def cancel(store: BatchStore, backend_for: BackendFor, batch_id: str) -> str:
    """Stop a running batch: its sandboxes are stopped, its collectors record every episode
    that had not finished as cancelled, and its report says `cancelled`."""
    receipt = load_receipt(store, batch_id)
    if receipt is None:
        return "unknown"
    if store.has_report(batch_id):
        return "already-reported"
    # Tell the collectors first (an episode that ends now is cancelled, not failed), stop the
    # sandboxes, then let the collectors finish the rest: the report never precedes the stop.
    store.set_flag(batch_id, FLAG_CANCEL)
    state = "cancelling"
    if receipt.run is not None:
        try:
            backend_for(receipt.run.backend).cancel_run(receipt.run)
        except TransientBackendError:
            raise
        except BackendError as exc:
            log.error("batch %s: stop not confirmed: %s", batch_id, exc)
            state = "cancelling (stop not confirmed)"
    store.set_flag(batch_id, FLAG_STOPPED)
    return state


# -- sweep -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Swept:
    batch_id: str
    action: str  # deleted | deleting | would-delete | left | forgotten | failed
    reason: str


def sweep(
    store: BatchStore,
    backend_for: BackendFor,
    backends: list[str],
    *,
    run_ttl: float,
    now: float,
    dry_run: bool,
    backend_for_run: Callable[[RunHandle], Backend] | None = None,
) -> list[Swept]:
    """The backstop behind `cleanup`: delete runs of ours that nothing else will delete (no
    live receipt, a kept run past its TTL, a cleanup that stalled), proving each by the UIDs
    in the run registry. Runs that carry our labels but are not in the registry are listed,
    never deleted: nothing proves we created them."""
    # A run is deleted where it was created (its recorded context), not where we point now.
    backend_for_run = backend_for_run or (lambda handle: backend_for(handle.backend))
    results: list[Swept] = []
    registry = store.registered_runs()
    for batch_id, entry in sorted(registry.items()):
        reason = _sweep_reason(store, batch_id, entry, run_ttl, now)
        if reason is None:
            continue
        run = entry.get("run")
        handle = RunHandle.from_dict(run) if isinstance(run, Mapping) else _partial(entry)
        if handle is None:
            if not dry_run:
                store.forget_run(batch_id)
            results.append(Swept(batch_id, "forgotten", f"{reason}; nothing was created"))
            continue
        if dry_run:
            results.append(Swept(batch_id, "would-delete", reason))
            continue
        try:
            gone = backend_for_run(handle).delete_run(handle)
        except BackendError as exc:
            results.append(Swept(batch_id, "failed", f"{reason}; {exc}"))
            continue
        if gone:
            store.forget_run(batch_id)
        results.append(Swept(batch_id, "deleted" if gone else "deleting", reason))
    for name in backends:
        for batch_id in backend_for(name).list_runs():
            if batch_id not in registry:
                results.append(
                    Swept(batch_id, "left", f"{name} run with our labels but no registry entry")
                )
    return results


def _sweep_reason(
    store: BatchStore, batch_id: str, entry: Mapping[str, Any], run_ttl: float, now: float
) -> str | None:
    receipt = load_receipt(store, batch_id)
    created = float(entry.get("created_at") or 0)
    if receipt is None:
        return "its receipt is gone (expired or lost)"
    report = store.report(batch_id)
    if report is None:
        deadline = created + receipt.spec.deadline_seconds + 3600
        return "no report an hour past its deadline" if now > deadline else None
    reported = float(report.get("reported_at") or created)
    if receipt.cleanup == CLEANUP_KEPT:
        return f"kept run past its TTL ({run_ttl:.0f}s)" if now > created + run_ttl else None
    if receipt.cleanup in (CLEANUP_SCHEDULED, CLEANUP_DELETING, None):
        stalled = now > reported + SWEEP_STALLED_CLEANUP_SECONDS
        return "its cleanup stalled" if stalled else None
    return f"cleanup ended {receipt.cleanup}"


def _partial(entry: Mapping[str, Any]) -> RunHandle | None:
    """A run cut short before its handle was recorded: what the registry proves of it."""
    if entry.get("backend") == "kubernetes":
        from rollout_worker.backends.kube.read import handle_from_receipt

        return handle_from_receipt(entry)
    return None


# -- warm pools ------------------------------------------------------------------------------
def fill_pool(
    store: BatchStore,
    backend: Backend,
    spec: BatchSpec,
    *,
    budget: int,
    idle_seconds: float,
    now: float,
) -> dict[str, Any]:
    """Refill the warm pool of a batch's shape to `spec.warm_pool` waiting sandboxes. The
    registry entry (the proof the drain checks) is written before anything is created."""
    if not isinstance(backend, PoolBackend):
        return {"pool": None, "reason": f"the {backend.name} backend has no warm pools"}
    key = backend.pool_key(spec)
    if key is None:
        return {"pool": None, "reason": "several images or a retry budget: no pool"}
    store.register_pool(key, {"key": key, "used_at": now, "size": spec.warm_pool})
    filled = backend.fill_pool(
        spec, spec.warm_pool, budget, idle_seconds, lambda fields: store.register_pool(key, fields)
    )
    return {"pool": key, **filled}


def drain_pools(
    store: BatchStore, backend: Backend, *, idle_seconds: float | None, now: float
) -> list[Swept]:
    """Empty the pools no batch asked to refill for `idle_seconds` (None: every pool). A pool
    in the cluster without a registry entry is reported, never deleted."""
    if not isinstance(backend, PoolBackend):
        return []
    results = []
    registry = store.registered_pools()
    for key, entry in registry.items():
        idle_for = now - float(entry.get("used_at") or 0)
        if idle_seconds is not None and idle_for < idle_seconds:
            continue
        reason = "drained on demand" if idle_seconds is None else f"idle for {idle_for:.0f}s"
        try:
            gone = backend.drain_pool(key, entry.get("uid"))
        except BackendError as exc:
            results.append(Swept(f"pool:{key}", "failed", f"{reason}; {exc}"))
            continue
        if gone:
            store.forget_pool(key)
        results.append(Swept(f"pool:{key}", "deleted" if gone else "deleting", reason))
    for key in backend.list_pools():
        if key not in registry:
            results.append(Swept(f"pool:{key}", "left", "pool with our labels but no registry"))
    return results

"""Admit a request and start its run: validation at the worker's edge, the receipt before the
first mutation, a redelivered submit adopting the run it started."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_wire.errors import BackendError, InvalidSpec, TransientBackendError
from rollout_wire.request import BatchSpec, is_batch_id, parse_spec
from rollout_wire.states import BatchStatus, SubmitStatus
from rollout_worker.backends import backend_name
from rollout_worker.backends.base import RunHandle
from rollout_worker.core.state import FLAG_CHORD, BackendFor, BatchStore, Limits, load_receipt
from rollout_worker.quantities import resource_problems
from rollout_worker.report import error_report
from rollout_worker.schedule import deadline_problem

log = logging.getLogger(__name__)


# -- submit ----------------------------------------------------------------------------------
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
        backend=backend_name(spec),
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
    status: SubmitStatus
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
            spec.batch_id,
            {"batch_id": spec.batch_id, "backend": backend_name(spec), "created_at": now},
        )
    else:
        stored = load_receipt(store, spec.batch_id)
        if stored is None or _comparable(stored.spec) != _comparable(spec):
            log.error("batch id %s reused with a different request; ignored", spec.batch_id)
            return Submitted(
                spec.batch_id, SubmitStatus.CONFLICT, [f"batch id {spec.batch_id} is taken"]
            )
        if store.has_report(spec.batch_id):
            return Submitted(spec.batch_id, SubmitStatus.DONE)
        spec = stored.spec  # keep the first delivery's submitted_at

    backend = backend_for(backend_name(spec))

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
        SubmitStatus.STARTED,
        warnings=warnings,
        spec=spec,
        run=run,
        dispatch=not store.has_flag(spec.batch_id, FLAG_CHORD),
    )


def _comparable(spec: BatchSpec) -> dict[str, Any]:
    return {name: value for name, value in spec.to_dict().items() if name != "submitted_at"}


def _reject(
    store: BatchStore, batch_id: Any, problems: list[str], request: Mapping[str, Any]
) -> Submitted:
    # Answer under the batch id only when no batch owns it: a malformed copy of a valid
    # batch's message must never overwrite that batch's outcome.
    if is_batch_id(batch_id) and store.load_receipt(batch_id) is None:
        store.publish_report(
            batch_id, error_report(batch_id, BatchStatus.REJECTED, problems, request)
        )
    log.warning("rejected batch %s: %s", batch_id, "; ".join(problems))
    return Submitted(
        batch_id if is_batch_id(batch_id) else None, SubmitStatus.REJECTED, list(problems)
    )


def fail(store: BatchStore, spec: BatchSpec, errors: list[str]) -> Submitted:
    """End a batch whose run could not start: its report says why."""
    store.publish_report(
        spec.batch_id, error_report(spec.batch_id, BatchStatus.ERROR, errors, spec.to_dict())
    )
    return Submitted(spec.batch_id, SubmitStatus.ERROR, list(errors), spec=spec)

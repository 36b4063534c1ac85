"""A run after its report: cleanup (ownership-checked by the backend), cancel, the sweeper's
backstop, and which backend reaches a run."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rollout_wire.errors import BackendError, TransientBackendError
from rollout_wire.states import Cleanup
from rollout_worker.backends import get_backend
from rollout_worker.backends.base import Backend, RunHandle
from rollout_worker.backends.kube.read import handle_from_receipt
from rollout_worker.core.state import (
    FLAG_CANCEL,
    FLAG_STOPPED,
    BackendFor,
    BatchStore,
    load_receipt,
)
from rollout_worker.settings import Settings

log = logging.getLogger(__name__)

# A deleting run is looked at again after this long (the deletion runs in Kubernetes, not in
# a worker slot).
CLEANUP_RECHECK_SECONDS = 2.0

# A report older than this whose run is still scheduled for deletion is the sweeper's to delete
# (its cleanup task was lost).
SWEEP_STALLED_CLEANUP_SECONDS = 600.0


# -- cleanup ---------------------------------------------------------------------------------
def cleanup_pending(store: BatchStore, batch_id: str) -> bool:
    """The report asked for the run's deletion and it has not ended: a redelivered callback or
    watchdog schedules the cleanup again (the first one may have died before sending it)."""
    report = store.report(batch_id)
    if report is None or report.get("cleanup") != Cleanup.SCHEDULED:
        return False
    receipt = load_receipt(store, batch_id)
    return receipt is not None and receipt.cleanup in (None, Cleanup.SCHEDULED, Cleanup.DELETING)


def cleanup(store: BatchStore, backend_for: BackendFor, batch_id: str) -> Cleanup:
    """Delete a reported batch's run (ownership-checked by the backend). Returns the cleanup
    state: Cleanup.DELETING means "look again later" (the deletion runs in the backend)."""
    receipt = load_receipt(store, batch_id)
    if receipt is None or receipt.run is None:
        return Cleanup.DELETED  # nothing was created, or the receipt expired with its run
    if receipt.cleanup in (Cleanup.DELETED, Cleanup.KEPT, Cleanup.FAILED):
        return receipt.cleanup
    try:
        gone = backend_for(receipt.run.backend).delete_run(receipt.run)
    except TransientBackendError:
        raise
    except BackendError as exc:
        log.error("batch %s: run not deleted: %s", batch_id, exc)
        store.update_receipt(batch_id, {"cleanup": Cleanup.FAILED, "cleanup_error": str(exc)})
        return Cleanup.FAILED
    state = Cleanup.DELETED if gone else Cleanup.DELETING
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
    if receipt.cleanup == Cleanup.KEPT:
        return f"kept run past its TTL ({run_ttl:.0f}s)" if now > created + run_ttl else None
    if receipt.cleanup in (Cleanup.SCHEDULED, Cleanup.DELETING, None):
        stalled = now > reported + SWEEP_STALLED_CLEANUP_SECONDS
        return "its cleanup stalled" if stalled else None
    return f"cleanup ended {receipt.cleanup}"


def _partial(entry: Mapping[str, Any]) -> RunHandle | None:
    """A run cut short before its handle was recorded: what the registry proves of it (a
    Kubernetes namespace's UID; a local run dir is only created with its handle)."""
    return handle_from_receipt(entry) if entry.get("backend") == "kubernetes" else None


# -- which backend reaches a run -------------------------------------------------------------
def backend_for_run(handle: RunHandle, settings: Settings, cache: dict[str, Backend]) -> Backend:
    """A Kubernetes run is reached through the context recorded when it was created, not the
    one the worker points at now."""
    context = handle.context if handle.backend == "kubernetes" else None
    if context in (None, "", "in-cluster"):
        key, wanted = handle.backend, settings
    else:
        key, wanted = f"{handle.backend}@{context}", replace(settings, kube_context=context)
    return cached_backend(cache, key, lambda: get_backend(handle.backend, wanted))


# Backends are made under one lock: a collector's threads ask for one at the same moment (a
# burst of first collects), and each backend made twice kept watches of its own (a profile
# found 3 s of CPU making them in two collectors of 64 threads).
_MAKING = threading.Lock()


def cached_backend(cache: dict[str, Backend], key: str, make: Callable[[], Backend]) -> Backend:
    """`cache[key]`, made once by `make` if missing, however many threads ask at once."""
    found = cache.get(key)
    if found is None:
        with _MAKING:
            found = cache.get(key)
            if found is None:
                found = cache[key] = make()
    return found


def sweep_backends(settings: Settings) -> list[str]:
    """The backends whose runs the sweeper lists: local always, Kubernetes (and its sandbox
    hosts, whose runs live in Redis) when configured."""
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    return ["local", "kubernetes", "hosts"] if settings.kubeconfig or in_cluster else ["local"]

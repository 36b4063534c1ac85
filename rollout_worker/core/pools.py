"""Warm pools in the lifecycle: refill behind a batch, drain the idle ones. The registry entry
(the proof the drain checks) is written before anything is created."""

from __future__ import annotations

from typing import Any

from rollout_wire.errors import BackendError
from rollout_wire.request import BatchSpec
from rollout_worker.backends.base import Backend, PoolBackend
from rollout_worker.core.runs import Swept
from rollout_worker.core.state import BatchStore


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

"""The pool lifecycle in `core` with an in-memory store and a stub pool backend: the registry
is written before a fill creates anything, an idle pool is drained, a busy one is not, and a pool
nobody registered is reported, never deleted."""

from __future__ import annotations

from typing import Any

from rollout_wire.request import BatchSpec, parse_spec
from rollout_worker import core
from rollout_worker.backends.base import PoolBackend, ReceiptUpdate
from tests.unit.stubs import MemoryStore, StubBackend


class StubPools:
    name = "stub"

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.pools: dict[str, dict[str, Any]] = {}
        self.drained: list[tuple[str, str | None]] = []
        self.busy: set[str] = set()

    def pool_key(self, spec: BatchSpec) -> str | None:
        return None if spec.infra_retries else f"shape-{spec.image}"

    def fill_pool(
        self, spec: BatchSpec, size: int, budget: int, idle_seconds: float, record: ReceiptUpdate
    ) -> dict[str, int]:
        key = self.pool_key(spec)
        assert key is not None
        # What a backend creates is named in the registry first.
        assert self.store.pools[key]["size"] == size
        record({"uid": f"uid-{key}"})
        self.pools[key] = {"waiting": min(size, budget)}
        return {"waiting": 0, "created": min(size, budget)}

    def drain_pool(self, key: str, namespace_uid: str | None) -> bool:
        self.drained.append((key, namespace_uid))
        if key in self.busy:
            return False
        self.pools.pop(key, None)
        return True

    def list_pools(self) -> dict[str, dict[str, Any]]:
        return dict(self.pools)


def spec(**changes: Any) -> BatchSpec:
    return parse_spec({"count": 2, "backend": "kubernetes", **changes}, max_episodes=10)


def test_fill_registers_the_pool_before_creating_it_and_drain_follows_idleness():
    store = MemoryStore()
    backend = StubPools(store)
    assert isinstance(backend, PoolBackend)
    filled = core.fill_pool(
        store, backend, spec(warm_pool=3), budget=2, idle_seconds=60, now=1000.0
    )
    assert filled == {"pool": "shape-python:3.12-alpine", "waiting": 0, "created": 2}
    entry = store.pools["shape-python:3.12-alpine"]
    assert entry["uid"] == "uid-shape-python:3.12-alpine" and entry["used_at"] == 1000.0

    # Not idle yet: untouched. Idle: drained with the registry's UID, then forgotten.
    assert core.drain_pools(store, backend, idle_seconds=60, now=1030.0) == []
    swept = core.drain_pools(store, backend, idle_seconds=60, now=1061.0)
    assert [(s.action, s.reason) for s in swept] == [("deleted", "idle for 61s")]
    assert backend.drained == [("shape-python:3.12-alpine", "uid-shape-python:3.12-alpine")]
    assert store.pools == {}


def test_a_busy_pool_stays_registered_and_an_unknown_one_is_only_reported():
    store = MemoryStore()
    backend = StubPools(store)
    core.fill_pool(store, backend, spec(warm_pool=1), budget=9, idle_seconds=60, now=0.0)
    backend.busy.add("shape-python:3.12-alpine")
    backend.pools["stranger"] = {"waiting": 4}
    swept = core.drain_pools(store, backend, idle_seconds=None, now=5.0)
    assert {(s.batch_id, s.action) for s in swept} == {
        ("pool:shape-python:3.12-alpine", "deleting"),
        ("pool:stranger", "left"),
    }
    assert "shape-python:3.12-alpine" in store.pools
    assert ("stranger", None) not in backend.drained


def test_no_pool_for_a_shape_that_cannot_have_one_or_a_backend_without_pools():
    store = MemoryStore()
    no_shape = core.fill_pool(
        store, StubPools(store), spec(infra_retries=1), budget=9, idle_seconds=60, now=0.0
    )
    assert no_shape["pool"] is None and store.pools == {}
    without = core.fill_pool(
        store, StubBackend(), spec(warm_pool=2), budget=9, idle_seconds=60, now=0.0
    )
    assert without["pool"] is None
    assert core.drain_pools(store, StubBackend(), idle_seconds=None, now=0.0) == []

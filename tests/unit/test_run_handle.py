"""Run handles per backend: receipts stored before the split (every field of both backends,
None where unused) still load, as the right class, and write back the same bytes but for the
other backend's always-empty fields."""

from __future__ import annotations

import orjson
import pytest

from rollout_wire.errors import BackendError
from rollout_wire.states import RunVerdict
from rollout_worker.backends.base import (
    HostRunHandle,
    KubeRunHandle,
    LocalRunHandle,
    RunHandle,
    WarmClaim,
    handle_as,
)

# As the code before the split wrote them (asdict of the one RunHandle), byte for byte.
STORED_KUBE = (
    b'{"backend":"kubernetes","batch_id":"b7","origin":1796119250.0,"episode_prefix":"rollout",'
    b'"context":"kind-rollout","infra_retries":1,"namespace":"rollout-b7",'
    b'"namespace_uid":"ns-uid","job_name":"rollout","job_uid":"job-uid",'
    b'"jobs":{"rollout":"job-uid","rollout-1":"job-uid-1"},"pool_namespace":"rollout-pool-ab",'
    b'"warm":[[0,"pool-ab-x1","uid-x1"],[3,"pool-ab-x2","uid-x2"]],"fed":false,'
    b'"run_dir":null,"run_uid":null,"isolation":null,"node":null}'
)
STORED_LOCAL = (
    b'{"backend":"local","batch_id":"b8","origin":1796119251.5,"episode_prefix":"ep-b8",'
    b'"context":"local:host-a","infra_retries":0,"namespace":null,"namespace_uid":null,'
    b'"job_name":null,"job_uid":null,"jobs":{},"pool_namespace":null,"warm":[],"fed":false,'
    b'"run_dir":"/var/rollout/runs/b8","run_uid":"run-uid","isolation":"bwrap",'
    b'"node":"host-a"}'
)
KUBE_ONLY = ("namespace", "namespace_uid", "job_name", "job_uid", "jobs", "pool_namespace")
LOCAL_ONLY = ("run_dir", "run_uid", "isolation", "node")


def without(stored: bytes, keys: tuple[str, ...]) -> bytes:
    data = orjson.loads(stored)
    return orjson.dumps({k: v for k, v in data.items() if k not in keys})


def test_a_stored_kubernetes_receipt_loads_as_a_kubernetes_handle():
    handle = RunHandle.from_dict(orjson.loads(STORED_KUBE))
    assert isinstance(handle, KubeRunHandle)
    assert handle.warm == (
        WarmClaim(0, "pool-ab-x1", "uid-x1"),
        WarmClaim(3, "pool-ab-x2", "uid-x2"),
    )
    assert handle.warm_pod(3) == ("pool-ab-x2", "uid-x2") and handle.warm_pod(1) is None
    assert handle.in_pool(0) and not handle.in_pool(1) and not handle.fed
    assert handle.job_uids() == {"rollout": "job-uid", "rollout-1": "job-uid-1"}
    assert (handle.namespace, handle.infra_retries) == ("rollout-b7", 1)
    # Written back: the same bytes, less the local fields it never used.
    assert orjson.dumps(handle.to_dict()) == without(STORED_KUBE, LOCAL_ONLY)
    assert RunHandle.from_dict(handle.to_dict()) == handle


def test_a_stored_local_receipt_loads_as_a_local_handle():
    handle = RunHandle.from_dict(orjson.loads(STORED_LOCAL))
    assert isinstance(handle, LocalRunHandle)
    assert (handle.run_dir, handle.run_uid, handle.isolation, handle.node) == (
        "/var/rollout/runs/b8",
        "run-uid",
        "bwrap",
        "host-a",
    )
    assert not handle.fed and handle.episode_id(2) == "ep-b8-2"
    assert orjson.dumps(handle.to_dict()) == without(STORED_LOCAL, (*KUBE_ONLY, "warm", "fed"))
    assert RunHandle.from_dict(handle.to_dict()) == handle


def test_a_kubernetes_handle_recorded_before_jobs_and_warm_existed_still_loads():
    stored = orjson.loads(STORED_KUBE)
    for key in ("jobs", "warm", "fed", "pool_namespace", "infra_retries"):
        del stored[key]
    handle = RunHandle.from_dict(stored)
    assert isinstance(handle, KubeRunHandle)
    assert handle.job_uids() == {"rollout": "job-uid"} and handle.warm == ()


def test_another_backend_gets_the_shared_fields_and_a_handle_is_checked_by_its_backend():
    stub = RunHandle.from_dict({**orjson.loads(STORED_LOCAL), "backend": "stub"})
    assert type(stub) is RunHandle and not stub.fed
    local = RunHandle.from_dict(orjson.loads(STORED_LOCAL))
    assert handle_as(LocalRunHandle, local) is local
    with pytest.raises(BackendError, match="is a local run"):
        handle_as(KubeRunHandle, local)


def test_a_warm_claim_is_stored_as_the_list_receipts_always_held():
    claim = WarmClaim.from_list([2, "pod", "uid"])
    assert claim == WarmClaim(2, "pod", "uid") and claim.to_list() == [2, "pod", "uid"]


def test_run_verdicts_are_the_job_controllers_words():
    words = ["Complete", "Failed", "Running", "Suspended", "Unknown"]
    assert [v.value for v in RunVerdict] == words
    assert orjson.dumps({"run_verdict": RunVerdict.COMPLETE}) == b'{"run_verdict":"Complete"}'


def test_a_host_run_handle_round_trips_as_its_own_kind():
    handle = HostRunHandle(
        backend="hosts",
        batch_id="b9",
        origin=1796119252.25,
        episode_prefix="ep-b9",
        context="hosts",
        infra_retries=2,
        run_uid="run-uid-9",
        program_sha="abc123",
    )
    stored = orjson.dumps(handle.to_dict())
    back = RunHandle.from_dict(orjson.loads(stored))
    assert isinstance(back, HostRunHandle) and back == handle
    assert (back.run_uid, back.program_sha, back.infra_retries) == ("run-uid-9", "abc123", 2)
    assert not back.fed and back.episode_id(4) == "ep-b9-4"
    assert handle_as(HostRunHandle, back) is back
    with pytest.raises(BackendError, match="hosts run"):
        handle_as(LocalRunHandle, back)

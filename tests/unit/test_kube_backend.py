"""KubernetesBackend driven against an in-memory API server: which calls come when, what a run
records, and how an episode without a Pod ends. The cluster tests (tests/integration
test_kubernetes_backend.py, test_warm_pool.py, tests/k8s) run the same against a real one."""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any

import orjson
import pytest
from kubernetes.client.rest import ApiException

from rollout_wire.errors import OwnershipError
from rollout_wire.request import parse_spec
from rollout_worker.backends.base import KubeRunHandle, WarmClaim
from rollout_worker.backends.kube.backend import KubernetesBackend
from rollout_worker.backends.kube.pools import WarmPools
from rollout_worker.backends.kube.watch import PodWatches
from rollout_worker.settings import Settings

OURS = {"rollout.dev/owner": "rollout", "rollout.dev/batch": "b1"}


class _Response:
    def __init__(self, obj: Any) -> None:
        self.data = orjson.dumps(obj)


class _WatchResponse:
    """A watch's answer: one event a line, as the API server streams them."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.lines = [orjson.dumps(e) + b"\n" for e in events]

    def stream(self, amt: Any = None, decode_content: Any = None) -> Any:
        yield from self.lines

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class _Client:
    """One API group: every method call is logged and answered by the server."""

    def __init__(self, server: _Server) -> None:
        self.server = server

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> _Response:
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("_")}
            self.server.calls.append((method, args[:1] if method.startswith("create") else args))
            if kwargs.get("watch"):
                return _WatchResponse(self.server.watch_events(method, args))
            return _Response(self.server.answer(method, args, kwargs))

        return call


class _Server:
    def __init__(self, job_condition: str = "Complete") -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.job_condition = job_condition
        self.uids = 0
        # The pool's Pods as each list (first) and then each watch event shows them.
        self.pool_pods: list[list[dict[str, Any]]] = []

    def watch_events(self, method: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        if method == "list_namespaced_pod" and args[0] == "pool-ns":
            return [{"type": "MODIFIED", "object": p} for ps in self.pool_pods[1:] for p in ps]
        return []

    def answer(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method.startswith("create_"):
            self.uids += 1
            body = copy.deepcopy(args[-1])
            body["metadata"] |= {
                "uid": f"uid-{self.uids}",
                "creationTimestamp": "2026-12-01T10:00:00Z",
            }
            if method == "create_namespaced_job":
                self.jobs[body["metadata"]["name"]] = body
            return body
        if method == "list_namespaced_job":
            condition = {"type": self.job_condition, "status": "True", "reason": "Why"}
            status = {"conditions": [condition], "failedIndexes": "1"}
            return {"items": [j | {"status": status} for j in reversed(self.jobs.values())]}
        if method == "read_namespaced_job":
            return self.jobs[args[0]]
        if method == "read_namespace":
            return {"metadata": {"name": args[0], "uid": "uid-1", "labels": OURS}}
        if method == "list_namespaced_pod" and args[0] == "pool-ns" and self.pool_pods:
            return {"items": self.pool_pods[0], "metadata": {"resourceVersion": "1"}}
        if method == "list_namespaced_event":
            return {"items": []}
        if method.startswith("list_"):
            return {"items": []}
        return {}


def _backend(server: _Server) -> KubernetesBackend:
    backend = KubernetesBackend.__new__(KubernetesBackend)
    backend.settings, backend.api, backend.context = Settings(), None, "ctx"
    backend.core = backend.batch = backend.nodes_api = backend.net = _Client(server)
    backend.watches = PodWatches()
    backend.pools = WarmPools(backend._call, backend._text, backend.core, backend.net, 2)
    backend.program = "PROGRAM"
    backend._jobs, backend._jobs_lock = {}, threading.Lock()
    return backend


def _spec(**fields: Any) -> Any:
    tasks = [
        {"id": "a", "statement": "s", "files": {"a.py": ""}, "test_command": ["true"]},
        {"id": "b", "statement": "s", "files": {"a.py": ""}, "test_command": ["true"]}
        | {"image": "img/two:1"},
    ]
    fields = {"batch_id": "b1", "tasks": tasks, "policy": {"url": "http://10.0.0.5:8000"}} | fields
    fields = {"backend": "kubernetes", "infra_retries": 1, "samples_per_task": 2, **fields}
    return parse_spec(fields, max_episodes=100)


class _NoPods:
    def wait(self, index: int, timeout: float, done: Any) -> dict[str, Any]:
        return {}


def test_a_run_creates_its_objects_in_order_and_records_each_before_the_next():
    server, records = _Server(), []
    handle = _backend(server).start_run(_spec(), records.append)
    created = [(m, a) for m, a in server.calls if m.startswith("create")]
    assert [m for m, _ in created] == [
        "create_namespace",
        "create_namespaced_config_map",
        "create_namespaced_network_policy",
        "create_namespaced_job",
        "create_namespaced_job",
    ]
    assert records[0] == {"context": "ctx", "namespace": "rollout-b1", "run_id": "b1"}
    assert {"uid": "uid-1"} in records
    assert records[-1] == {"job_uid": "uid-4", "jobs": {"rollout": "uid-4", "rollout-1": "uid-5"}}
    assert handle.jobs == {"rollout": "uid-4", "rollout-1": "uid-5"}
    assert handle.namespace_uid == "uid-1" and handle.origin > 0


def test_finished_run_records_every_job_in_creation_order_and_its_verdict():
    server = _Server(job_condition="Failed")
    backend = _backend(server)
    handle = backend.start_run(_spec(), lambda _: None)
    finished = backend.finish_run(_spec(), handle)
    assert finished.verdict == "Failed"
    assert set(finished.records) == {
        "pods.json",
        "events.txt",
        "job.json",
        "job-submitted.json",
        "job-rollout-1.json",
        "job-rollout-1-submitted.json",
    }
    listed = [a for m, a in server.calls if m == "list_namespaced_job"]
    assert listed  # the Jobs were listed (and sorted back into the handle's order)


@pytest.mark.parametrize(
    ("condition", "index", "reason"),
    [
        ("Failed", 1, "Job Failed: its Pod failed or was deleted before it could be read"),
        ("Complete", 0, "Job Complete: Why; no Pod of this episode is left to read"),
        ("Running", 0, None),
    ],
)
def test_an_episode_without_a_pod_ends_with_its_job(condition, index, reason):
    server = _Server(job_condition=condition)
    backend = _backend(server)
    handle = backend.start_run(_spec(), lambda _: None)
    backend._pod_watch = lambda _handle: _NoPods()  # type: ignore[method-assign]
    obs = backend.wait_episode(handle, index, 0.1)
    assert (obs.phase, obs.reason) == (("Pending", None) if reason is None else ("Failed", reason))


def test_delete_refuses_a_namespace_whose_job_is_not_the_one_recorded():
    server = _Server()
    backend = _backend(server)
    handle = backend.start_run(_spec(), lambda _: None)
    assert backend.delete_run(handle) is False  # deleting: not gone yet
    assert ("delete_namespace", ("rollout-b1",)) in server.calls
    stranger = dataclasses.replace(handle, jobs={"rollout": "someone-else"})
    with pytest.raises(OwnershipError):
        backend.delete_run(stranger)


def test_an_object_in_the_way_is_adopted_only_when_its_labels_say_it_is_ours():
    server = _Server()
    backend = _backend(server)

    def taken(*_args: Any, **_kwargs: Any) -> Any:
        raise ApiException(status=409, reason="Conflict")

    backend.core = _Client(server)
    backend.core.create_namespace = taken  # type: ignore[attr-defined]
    assert backend.start_run(_spec(), lambda _: None).namespace_uid == "uid-1"
    with pytest.raises(OwnershipError):
        backend.start_run(_spec(batch_id="b2"), lambda _: None)


def _warm_pod(name: str, container: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    status = {"phase": phase, "containerStatuses": [{"name": "episode", "state": container}]}
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": OURS}, "status": status}


def test_a_warm_run_read_as_its_report_comes_out_ends_when_its_pods_end():
    """The report comes from the episodes' events, before the kubelet says their containers
    exited: the records wait (bounded) for that, so the receipt gets completed_at and the
    client its client_job_complete_seconds (None on the old code, read once at once)."""
    server = _Server()
    backend = _backend(server)
    claims = (WarmClaim(0, "w0", "uid-w0"), WarmClaim(1, "w1", "uid-w1"))
    handle = KubeRunHandle(
        batch_id="b1",
        episode_prefix="b1",
        context="ctx",
        backend="kubernetes",
        origin=1.0,
        namespace="rollout-b1",
        pool_namespace="pool-ns",
        warm=claims,
    )
    running = {"running": {"startedAt": "2026-12-01T10:00:01Z"}}
    exited = {"terminated": {"exitCode": 0, "finishedAt": "2026-12-01T10:00:05Z"}}
    later = {"terminated": {"exitCode": 0, "finishedAt": "2026-12-01T10:00:06Z"}}
    server.pool_pods = [
        [_warm_pod("w0", exited), _warm_pod("w1", running)],
        [_warm_pod("w1", later)],
    ]
    finished = backend.finish_run(_spec(count=2, samples_per_task=1), handle)
    assert finished.verdict == "Complete"
    assert finished.completed_at == 1796119206.0  # the last container's finishedAt
    assert ("list_namespaced_pod", ("pool-ns",)) in server.calls

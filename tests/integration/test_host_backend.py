"""HostBackend (the Celery side of `isolation: host`) on a real redis-server, with the hosts'
side played through the queue (HostQueue.take/finish, as an agent does): what preflight
refuses, a start recorded before it exists, waits woken by the done signal, records, cancel,
delete by run_uid."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis

from rollout_wire import constants as k
from rollout_wire.errors import BackendError, BackendUnavailable, OwnershipError
from rollout_wire.request import parse_spec
from rollout_wire.states import RunVerdict
from rollout_worker.backends import get_backend
from rollout_worker.backends.base import HostRunHandle
from rollout_worker.backends.host import backend as host_backend
from rollout_worker.backends.host.backend import HostBackend, program_sha
from rollout_worker.backends.host.queue import HostQueue
from rollout_worker.cli.stack import LocalStack
from rollout_worker.settings import Settings

pytestmark = pytest.mark.redis
TASK = {
    "id": "t",
    "statement": "Do it.",
    "files": {"a.txt": "a\n"},
    "tests": {"test.sh": "true\n"},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
}
POLICY = {"url": "http://10.0.0.1:8000/v1"}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    stack = LocalStack()
    stack.start_redis()
    try:
        yield stack.redis_url
    finally:
        stack.stop()


@pytest.fixture
def backend(server: str) -> HostBackend:
    redis.Redis.from_url(server).flushdb()
    made = get_backend("hosts", Settings(redis_url=server))
    assert isinstance(made, HostBackend)
    return made


def spec(batch: str = "b", **fields: Any):
    base = {"batch_id": batch, "backend": "kubernetes", "isolation": "host"}
    if "tasks" not in fields:
        base |= {"count": 3, "parallelism": 2}
    return parse_spec(base | fields, max_episodes=None)


def live_host(queue: HostQueue, name: str = "h1", **info: Any) -> None:
    queue.heartbeat(name, {"slots": 2, "free": 2, "program_sha": program_sha(), **info})


def started(backend: HostBackend, batch: str = "b", **fields: Any) -> HostRunHandle:
    live_host(backend.queue)
    s = spec(batch, **fields)
    backend.preflight(s)
    return backend.start_run(s, lambda _: None)


def ok(index: int, node: str = "h1") -> dict[str, Any]:
    return {
        "index": index,
        "episode_id": f"ep-{index}",
        "phase": "Succeeded",
        "node": node,
        "exit_code": 0,
        "finished_at": time.time(),
        "retried": [],
    }


def refused(backend: HostBackend, s) -> str:
    with pytest.raises(BackendUnavailable) as info:
        backend.preflight(s)
    return str(info.value)


def test_preflight_refuses_before_anything_exists(backend):
    assert "no live sandbox host" in refused(backend, spec())
    live_host(backend.queue, "leaving", draining=True)
    assert "no live sandbox host" in refused(backend, spec())
    backend.queue.heartbeat("old", {"slots": 1, "program_sha": "0" * 64})
    assert "no sandbox host runs this worker's episode program" in refused(backend, spec())
    live_host(backend.queue, slot_memory_bytes=2**20)
    image_task = TASK | {"id": "i", "image": "rollout.local/i:1", "files": {}}
    env_task = TASK | {"id": "e", "env": {"verifier": {"TOKEN": "${TOKEN}"}}}
    why = refused(backend, spec(tasks=[image_task, env_task], policy=POLICY, agent_env="/venv"))
    # The live host carries no task image: refused by its heartbeat (backend.image_problems).
    image = "task image rollout.local/i:1 (folder rollout.local_i_1): no live sandbox host"
    for part in (image, "'e' has env tables", "agent_env /venv"):
        assert part in why
    assert "memory bytes" in why and "over a host slot's (1048576)" in why
    assert backend.queue.runs() == {} and backend.queue.redis.llen(k.HOSTS_TODO_KEY) == 0


def test_preflight_passes_a_file_batch_a_live_host_can_run(backend):
    live_host(backend.queue, slot_memory_bytes=2**40)
    assert backend.preflight(spec(tasks=[TASK], policy=POLICY)) == []
    # warm_pool: the hosts keep waiting sandboxes (host/warm.py); a batch whose tasks a waiting
    # sandbox cannot run (TASK's hidden tests need a grader's sandbox) is told it runs cold.
    assert backend.preflight(spec(warm_pool=2)) == []
    (warning,) = backend.preflight(spec(tasks=[TASK], policy=POLICY, warm_pool=2))
    assert "the hosts start this batch's episodes cold (task 't' is graded apart" in warning


def test_start_records_the_handle_before_the_run_exists_and_a_second_start_adopts_it(backend):
    seen: list[tuple[dict[str, Any], dict[str, str]]] = []
    s = spec(count=3, parallelism=2)
    first = backend.start_run(s, lambda fields: seen.append((fields, backend.queue.run_info("b"))))
    assert seen[0][1] == {}  # recorded while nothing was enqueued
    assert seen[0][0]["run"]["run_uid"] == first.run_uid and first.program_sha == program_sha()
    again = backend.start_run(s, lambda fields: None)
    assert (again.run_uid, again.origin) == (first.run_uid, first.origin)
    assert backend.queue.redis.lrange(k.HOSTS_TODO_KEY, 0, -1) == [b"b:0", b"b:1"]
    doc = orjson.loads(backend.queue.run_doc("b") or b"{}")
    assert doc["run_uid"] == first.run_uid and doc["created_at"] == first.origin
    assert doc["spec"]["isolation"] == "host" and doc["limits"]["memory_bytes"] > 0
    assert backend.list_runs() == ["b"]


def test_a_wait_is_woken_by_the_hosts_finish_and_reads_its_status_and_log(backend):
    handle = started(backend)
    pending = backend.wait_episode(handle, 0, 0.05)
    assert (pending.phase, pending.node) == ("Pending", None)
    lease = backend.queue.take("h1", 1)
    assert lease is not None
    running = backend.wait_episode(handle, 0, 0.05)
    assert (running.phase, running.node) == ("Running", "h1")
    assert backend.wait_ended(handle, [0, 1], 0.05, ready=frozenset()) == []
    later = threading.Timer(0.5, backend.queue.finish, (lease, ok(0), b"the log\n"))
    later.start()
    began = time.monotonic()
    obs = backend.wait_episode(handle, 0, 20)
    assert time.monotonic() - began < 10  # the done signal woke it, not the timeout
    assert (obs.phase, obs.node, obs.exit_code) == ("Succeeded", "h1", 0)
    assert backend.read_output(handle, obs) == "the log\n"
    assert backend.wait_ended(handle, [0, 1], 1, ready=frozenset()) == [0]


def test_past_the_deadline_an_untaken_episode_ends_deadline_exceeded(backend):
    handle = started(backend, deadline_seconds=1, episode_timeout_seconds=1)
    time.sleep(1.1)
    obs = backend.wait_episode(handle, 2, 5)
    assert (obs.phase, obs.reason) == ("Failed", "DeadlineExceeded")


def test_a_lost_host_is_reaped_by_resume_run_and_its_episode_runs_again(backend):
    handle = started(backend, infra_retries=1)
    lease = backend.queue.take("h1", 1)
    assert lease is not None
    backend.queue.redis.delete(k.host_batch_key("b", f"lease:{lease.index}"))
    backend.resume_run(handle)
    again = backend.queue.take("h2", 1)
    assert again is not None and (again.index, again.attempt) == (0, 1)
    assert backend.queue.finish(
        again, ok(0, "h2") | {"retried": backend.queue.attempts("b", 0)}, b""
    )


def test_finish_run_records_where_each_episode_ran_and_its_attempts(backend):
    handle = started(backend, count=2, parallelism=2, infra_retries=1)
    s = spec(count=2, parallelism=2, infra_retries=1)
    assert backend.run_status(s, handle).verdict == RunVerdict.RUNNING
    first = backend.queue.take("h1", 1)
    assert first is not None
    backend.queue.redis.delete(k.host_batch_key("b", f"lease:{first.index}"))
    backend.resume_run(handle)
    leases = [backend.queue.take(host, 1) for host in ("h2", "h1")]
    for lease in leases:
        assert lease is not None
        node = "h2" if lease.attempt else "h1"
        records = {f"episode-{lease.index}.attempt0.log": b"first try"} if lease.attempt else None
        assert backend.queue.finish(lease, ok(lease.index, node), b"", records)
    done = backend.finish_run(s, handle)
    assert done.verdict == RunVerdict.COMPLETE and done.completed_at
    assert done.facts == {"isolation": "host", "hosts": {"h1": 1, "h2": 1}}
    placed = orjson.loads(done.records["hosts.json"])
    assert placed["0"]["host"] == "h2" and placed["0"]["attempts"][0]["host"] == "h1"
    assert placed["1"] == {"host": "h1", "attempts": []}
    assert done.records["episode-0.attempt0.log"] == "first try"


def test_cancel_waits_until_no_host_runs_the_batch(backend):
    handle = started(backend)
    lease = backend.queue.take("h1", 1)
    assert lease is not None

    def host_stops_it() -> None:  # what an agent does on seeing its batch stopped
        while not backend.queue.stopped("b"):
            time.sleep(0.05)
        time.sleep(0.5)
        backend.queue.finish(lease, ok(0) | {"phase": "Failed", "reason": "Stopped"}, b"")

    threading.Thread(target=host_stops_it).start()
    began = time.monotonic()
    backend.cancel_run(handle)
    assert time.monotonic() - began >= 0.4 and backend.queue.taken("b") == {}
    assert backend.queue.take("h2", 0.1) is None  # nothing more is taken


def test_cancel_says_so_when_a_host_never_lets_go(backend, monkeypatch):
    monkeypatch.setattr(host_backend, "CANCEL_WAIT_SECONDS", 0.5)
    handle = started(backend)
    assert backend.queue.take("h1", 1) is not None
    with pytest.raises(BackendError, match="still run episodes of batch b"):
        backend.cancel_run(handle)


def test_delete_needs_the_receipts_run_uid_and_leaves_no_key(backend):
    handle = started(backend)
    stranger = HostRunHandle(**(handle.to_dict() | {"run_uid": "not-ours"}))
    with pytest.raises(OwnershipError, match="not the receipt's not-ours"):
        backend.delete_run(stranger)
    assert backend.delete_run(handle) and backend.delete_run(handle)
    assert backend.queue.redis.keys(k.host_batch_key("b", "*")) == []
    assert backend.list_runs() == []
    with pytest.raises(BackendError, match="is gone"):
        backend.wait_episode(handle, 0, 0.05)
    assert backend.wait_ended(handle, [0, 2], 0.05, ready=frozenset()) == [0, 2]


def test_preflight_refuses_a_policy_endpoint_outside_a_live_hosts_policy_egress(backend):
    # The hosts' NetworkPolicy lets them reach 10.9.0.0/16 port 8000 only (their heartbeats
    # say so, from --policy-egress): POLICY (10.0.0.1:8000) could never be asked.
    live_host(backend.queue, "h1", policy_egress=[{"cidr": "10.9.0.0/16", "port": 8000}])
    why = refused(backend, spec(tasks=[TASK], policy=POLICY))
    assert "policy endpoint 10.0.0.1:8000 is outside the policy egress" in why
    assert "['h1']" in why and "10.9.0.0/16:8000" in why
    wrong_port = {"url": "http://10.9.1.2:9000/v1"}
    assert "10.9.1.2:9000" in refused(backend, spec(tasks=[TASK], policy=wrong_port))
    assert backend.queue.runs() == {} and backend.queue.redis.llen(k.HOSTS_TODO_KEY) == 0
    inside = {"url": "http://10.9.1.2:8000/v1"}
    assert backend.preflight(spec(tasks=[TASK], policy=inside)) == []
    # Any host takes any episode: one host that cannot reach it is enough to refuse.
    live_host(backend.queue, "h2", policy_egress=[])
    assert "['h2']" in refused(backend, spec(tasks=[TASK], policy=inside))
    assert backend.preflight(spec()) == []  # no policy: nothing to reach

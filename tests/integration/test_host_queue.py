"""The sandbox hosts' Redis protocol (rollout_worker/backends/host/queue.py) on a real
redis-server: release order, fencing, reap, lazy drop, idempotent enqueue, delete."""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest
import redis

from rollout_wire import constants as k
from rollout_worker.backends.host.agent import Taker
from rollout_worker.backends.host.queue import CANCEL_FLAG, HostQueue, Lease
from rollout_worker.cli.stack import LocalStack

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    stack = LocalStack()
    stack.start_redis()
    try:
        yield stack.redis_url
    finally:
        stack.stop()


@pytest.fixture
def queue(server: str) -> Iterator[HostQueue]:
    client = redis.Redis.from_url(server)
    client.flushdb()
    yield HostQueue(client)
    client.close()


def doc(batch: str) -> bytes:
    return orjson.dumps({"episode_prefix": f"{batch}-ep", "image_id": "file-task"})


def enqueue(q: HostQueue, batch: str, count: int = 4, parallelism: int = 2, **kw: float) -> None:
    deadline = float(kw.get("deadline_at", time.time() + 600))
    retries = int(kw.get("infra_retries", 0))
    q.enqueue(batch, f"uid-{batch}", doc(batch), count, parallelism, deadline, retries)


def todo(q: HostQueue) -> list[str]:
    return [item.decode() for item in q.redis.lrange(k.HOSTS_TODO_KEY, 0, -1)]


def lose(q: HostQueue, lease: Lease) -> None:
    """What a host's silence for LEASE_SECONDS does: its lease key expires."""
    q.redis.delete(k.host_batch_key(lease.batch, f"lease:{lease.index}"))


def status(reason: str = "Completed") -> dict[str, object]:
    return {"phase": "Succeeded", "reason": reason, "exit_code": 0}


def test_enqueue_is_idempotent_and_releases_only_the_batchs_parallelism(queue):
    enqueue(queue, "b", count=5, parallelism=2)
    queue.enqueue("b", "other-uid", doc("b"), 5, 2, time.time() + 600, 0)
    assert todo(queue) == ["b:0", "b:1"]
    assert queue.run_info("b")["run_uid"] == "uid-b"
    assert queue.run_doc("b") == doc("b")
    assert queue.runs()["b"]["run_uid"] == "uid-b"


def test_each_finish_releases_the_next_index_so_parallelism_holds_across_hosts(queue):
    enqueue(queue, "b", count=4, parallelism=2)
    a, c = queue.take("h1", 1), queue.take("h2", 1)
    assert a is not None and c is not None
    assert (a.index, c.index, a.attempt) == (0, 1, 0)
    assert queue.take("h1", 0.05) is None  # two running: nothing more released
    assert queue.taken("b") == {0: "h1", 1: "h2"}
    assert queue.finish(c, status(), b"log 1")
    assert todo(queue) == ["b:2"]
    assert queue.finish(a, status(), b"log 0")
    assert todo(queue) == ["b:2", "b:3"]
    assert queue.log("b", 1) == b"log 1"
    assert queue.status("b", 0) == status()
    assert queue.redis.lrange(k.done_key("b", 0), 0, -1) == [b"1"]  # the collector's DoneSignal
    rest = [queue.take("h1", 1), queue.take("h1", 1)]
    assert [lease.index for lease in rest if lease] == [2, 3]
    for lease in rest:
        assert lease and queue.finish(lease, status(), b"")
    assert todo(queue) == [] and queue.taken("b") == {}
    assert sorted(queue.statuses("b")) == [0, 1, 2, 3]


def test_a_reaped_lease_is_requeued_at_the_head_and_its_stale_token_writes_nothing(queue):
    enqueue(queue, "b", count=3, parallelism=2, infra_retries=1)
    first = queue.take("h1", 1)
    assert first is not None and first.index == 0
    assert queue.renew("h1", [first]) == []
    lose(queue, first)
    assert queue.reap("b") == [0]
    assert todo(queue) == ["b:0", "b:1"]  # at the head: it runs next
    [entry] = queue.attempts("b", 0)
    assert (entry["reason"], entry["host"]) == ("HostLost", "h1")
    # The lost host comes back: its lease is gone and its finish is dropped whole.
    assert queue.renew("h1", [first]) == [first]
    assert not queue.finish(first, status("stale"), b"stale log", {"x": b"y"})
    assert queue.status("b", 0) is None and queue.log("b", 0) is None
    assert queue.records("b") == {}
    again = queue.take("h2", 1)
    assert again is not None and (again.index, again.attempt) == (0, 1)
    assert again.token != first.token
    assert queue.finish(again, status(), b"good", {"episode-0.attempt0.log": b"a0"})
    assert queue.status("b", 0) == status() and queue.log("b", 0) == b"good"
    assert queue.records("b") == {"episode-0.attempt0.log": b"a0"}
    assert not queue.finish(first, status("late"), b"late")  # still nothing, even now


def test_a_lease_lost_more_often_than_infra_retries_ends_failed_host_lost(queue):
    enqueue(queue, "b", count=2, parallelism=1, infra_retries=1)
    for expected in ([0], []):
        lease = queue.take("h1", 1)
        assert lease is not None and lease.index == 0
        lose(queue, lease)
        assert queue.reap("b") == expected
    got = queue.status("b", 0)
    assert got is not None
    assert (got["phase"], got["reason"], got["node"], got["exit_code"]) == (
        "Failed",
        "HostLost",
        "h1",
        None,
    )
    assert got["episode_id"] == "b-ep-0-retry1" and got["image_id"] == "file-task"
    assert [a["reason"] for a in got["retried"]] == ["HostLost"]
    assert queue.redis.llen(k.done_key("b", 0)) == 1
    assert todo(queue) == ["b:1"]  # the failure freed a slot: the next index is released


def test_without_retries_a_lost_episode_fails_at_once_with_an_empty_retried(queue):
    enqueue(queue, "b", count=1, parallelism=1)
    lease = queue.take("h1", 1)
    assert lease is not None
    lose(queue, lease)
    assert queue.reap("b") == []
    got = queue.status("b", 0)
    assert got is not None and got["reason"] == "HostLost" and got["retried"] == []


def test_a_live_lease_is_never_reaped(queue):
    enqueue(queue, "b", count=1, parallelism=1, infra_retries=3)
    lease = queue.take("h1", 1)
    assert lease is not None
    assert queue.reap("b") == [] and queue.taken("b") == {0: "h1"}
    assert queue.status("b", 0) is None


@pytest.mark.parametrize("how", ["stop", "cancel-flag", "delete"])
def test_take_drops_the_items_of_a_stopped_or_deleted_batch(queue, how):
    enqueue(queue, "b", count=3, parallelism=2)
    if how == "stop":
        queue.stop("b")
    elif how == "cancel-flag":
        queue.redis.set(k.flag_key("b", CANCEL_FLAG), 1)
    else:
        assert queue.delete("b", "uid-b")
    assert queue.stopped("b")
    assert queue.take("h1", 0.1) is None
    assert todo(queue) == [] and queue.statuses("b") == {}
    assert queue.redis.llen(k.hosts_taking_key("h1")) == 0


def test_stop_of_an_unknown_batch_creates_nothing(queue):
    queue.stop("never")
    assert queue.redis.keys("*") == []


def test_take_past_the_deadline_ends_the_episode_deadline_exceeded(queue):
    enqueue(queue, "b", count=3, parallelism=1, deadline_at=time.time() - 1)
    assert queue.take("h1", 0.1) is None
    got = queue.statuses("b")
    assert sorted(got) == [0, 1, 2]  # each drop released the next, which was dropped too
    assert {s["reason"] for s in got.values()} == {"DeadlineExceeded"}
    assert queue.redis.llen(k.done_key("b", 2)) == 1


def test_reap_past_the_deadline_ends_every_untaken_episode(queue):
    enqueue(queue, "b", count=4, parallelism=2)
    held = queue.take("h1", 1)
    assert held is not None
    queue.redis.hset(k.host_batch_key("b", "run"), "deadline_at", repr(time.time() - 1))
    queue.reap("b")
    got = queue.statuses("b")
    assert sorted(got) == [1, 2, 3]  # the held one is its host's to end (it kills it)
    assert queue.finish(held, status("DeadlineExceeded"), b"")
    assert queue.take("h2", 0.1) is None and todo(queue) == []


def test_an_item_a_dead_host_moved_but_never_took_goes_back_on_reap(queue):
    enqueue(queue, "b", count=2, parallelism=2)
    queue.heartbeat("dead", {"slots": 1})
    queue.heartbeat("live", {"slots": 2})
    queue.redis.lmove(k.HOSTS_TODO_KEY, k.hosts_taking_key("dead"), "LEFT", "RIGHT")
    queue.redis.delete(k.hosts_seen_key("dead"))  # its heartbeat expired
    assert set(queue.hosts()) == {"live"}
    queue.reap("b")
    assert todo(queue) == ["b:0", "b:1"]
    assert set(queue.redis.hkeys(k.HOSTS_ALIVE_KEY)) == {b"live"}


def test_a_restarted_host_recovers_what_it_moved_but_never_took(queue):
    enqueue(queue, "b", count=2, parallelism=2)
    queue.redis.lmove(k.HOSTS_TODO_KEY, k.hosts_taking_key("h1"), "LEFT", "RIGHT")
    assert queue.recover("h1") == 1
    assert todo(queue) == ["b:0", "b:1"]


def test_delete_needs_the_runs_uid_and_then_leaves_no_host_key(queue):
    enqueue(queue, "b", count=2, parallelism=2, infra_retries=1)
    enqueue(queue, "other", count=1, parallelism=1)
    lease = queue.take("h1", 1)
    assert lease is not None
    assert queue.finish(lease, status(), b"log", {"r": b"1"})
    held = queue.take("h1", 1)
    assert held is not None
    assert not queue.delete("b", "uid-wrong")
    assert queue.run_info("b")["run_uid"] == "uid-b"
    assert queue.delete("b", "uid-b")
    assert queue.redis.keys(k.host_batch_key("b", "*")) == []
    assert "b" not in queue.runs() and "other" in queue.runs()
    assert not queue.finish(held, status(), b"after delete")
    assert queue.redis.keys(k.host_batch_key("b", "*")) == []
    assert queue.delete("b", "uid-b")  # again: nothing left, still fine


def test_the_heartbeat_expires_and_a_leaving_host_is_gone_at_once(queue):
    queue.heartbeat("h1", {"slots": 3, "free": 3})
    queue.heartbeat("h2", {"slots": 1, "free": 0})
    assert queue.hosts()["h1"]["slots"] == 3 and "seen_at" in queue.hosts()["h1"]
    assert 0 < queue.redis.pttl(k.hosts_seen_key("h1")) <= 15000
    queue.leave("h2")
    assert set(queue.hosts()) == {"h1"}


def test_the_cancel_flag_name_is_the_cores():
    from rollout_worker.core.state import FLAG_CANCEL

    assert CANCEL_FLAG == FLAG_CANCEL


def test_a_take_that_fails_after_its_move_puts_the_item_back(queue, monkeypatch):
    enqueue(queue, "b", count=1, parallelism=1)
    taker = Taker(HostQueue(queue.redis), "h1", slots=1)
    script = taker.queue._take
    calls: list[int] = []

    def answer_lost(*args: object, **kwargs: object) -> object:
        """The first TAKE's answer never comes back (after BLMOVE moved the item)."""
        calls.append(1)
        if len(calls) == 1:
            raise redis.ConnectionError("connection lost")
        return script(*args, **kwargs)

    monkeypatch.setattr(taker.queue, "_take", answer_lost)
    taker.start()
    try:
        lease = taker.inbox.get(timeout=10)
    finally:
        taker.stop.set()
        taker.join(5)
    assert (lease.batch, lease.index, len(calls)) == ("b", 0, 2)
    assert queue.redis.llen(k.hosts_taking_key("h1")) == 0
    assert queue.taken("b") == {0: "h1"}


def test_each_client_leases_for_its_own_length(queue):
    enqueue(queue, "b", count=2, parallelism=2)
    short = HostQueue(queue.redis, lease_seconds=2.0)  # an agent's --lease-seconds 2
    mine, theirs = short.take("h1", 1), queue.take("h2", 1)
    assert mine is not None and theirs is not None

    def ttl(lease: Lease) -> int:
        return int(queue.redis.pttl(k.host_batch_key("b", f"lease:{lease.index}")))

    assert 0 < ttl(mine) <= 2000 < 14000 < ttl(theirs) <= 15000
    assert short.renew("h1", [mine]) == [] and 0 < ttl(mine) <= 2000
    assert queue.renew("h2", [theirs]) == [] and ttl(theirs) > 14000


def test_a_host_of_another_program_puts_the_item_back_untouched_for_a_host_of_the_batchs(queue):
    # A rolling update: the batch was submitted by workers of program "new"; a host still on
    # "old" must not run it, nor spend its retries. A host of "new" takes it.
    new, old = "a" * 64, "b" * 64
    body = orjson.dumps({"episode_prefix": "s-ep", "image_id": "file-task", "program_sha": new})
    queue.enqueue("s", "uid-s", body, 1, 1, time.time() + 600, 1)
    began = time.monotonic()
    assert queue.take("old-host", 0.3, old) is None
    assert time.monotonic() - began >= 0.25  # it paused, no busy loop on the one item
    assert todo(queue) == ["s:0"] and queue.attempts("s", 0) == []
    assert queue.statuses("s") == {} and queue.taken("s") == {}
    assert queue.redis.llen(k.hosts_taking_key("old-host")) == 0
    lease = queue.take("new-host", 1, new)
    assert lease is not None and (lease.index, lease.attempt) == (0, 0)
    assert queue.taken("s") == {0: "new-host"}


def test_with_no_host_of_its_program_a_batch_ends_at_its_deadline(queue):
    body = orjson.dumps({"episode_prefix": "d-ep", "image_id": "file-task", "program_sha": "a"})
    queue.enqueue("d", "uid-d", body, 1, 1, time.time() + 0.5, 0)
    assert queue.take("old-host", 0.2, "b") is None and todo(queue) == ["d:0"]
    time.sleep(0.5)
    assert queue.take("old-host", 0.2, "b") is None and todo(queue) == []
    assert queue.status("d", 0)["reason"] == "DeadlineExceeded"


def demand(q: HostQueue) -> list[str]:
    return sorted(item.decode() for item in q.redis.lrange(k.HOSTS_DEMAND_KEY, 0, -1))


def test_demand_counts_what_is_released_and_not_ended_running_or_waiting(queue):
    # KEDA sizes the hosts on it: busy hosts that keep up leave the work list empty, but
    # their running episodes are still demand.
    enqueue(queue, "m", count=4, parallelism=2, infra_retries=1)
    assert demand(queue) == ["m:0", "m:1"] and len(todo(queue)) == 2
    a, b = queue.take("h1", 1), queue.take("h2", 1)
    assert a is not None and b is not None
    assert todo(queue) == [] and demand(queue) == ["m:0", "m:1"]  # running: still demand
    assert queue.finish(a, {"phase": "Succeeded"}, b"")
    assert demand(queue) == ["m:1", "m:2"]  # one ended, the next released
    # A host lost: requeued with a retry left (still demand), then ended HostLost.
    queue.redis.delete(k.host_batch_key("m", f"lease:{b.index}"))
    assert queue.reap("m") == [b.index] and demand(queue) == ["m:1", "m:2"]
    again = queue.take("h1", 1)
    assert again is not None
    queue.redis.delete(k.host_batch_key("m", f"lease:{again.index}"))
    queue.reap("m")
    assert queue.status("m", again.index)["reason"] == "HostLost"
    assert demand(queue) == ["m:2", "m:3"]
    # Stopped: what a host takes of it is dropped, and is no demand any more.
    queue.stop("m")
    while queue.take("h1", 0.05) is not None:
        pass
    assert todo(queue) == [] and demand(queue) == []
    # Deleted with episodes waiting: their demand goes with it.
    enqueue(queue, "n", count=3, parallelism=3)
    assert len(demand(queue)) == 3
    assert queue.delete("n", "uid-n") and demand(queue) == []
    # Past its deadline: ended DeadlineExceeded, no demand.
    enqueue(queue, "p", count=2, parallelism=1, deadline_at=time.time() - 1)
    assert queue.take("h1", 0.1) is None and demand(queue) == []

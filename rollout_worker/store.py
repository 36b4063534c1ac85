"""Redis storage for receipts, episode rows, logs, records and reports.

Each write that must happen once is a Lua script, so a redelivered task can repeat it freely:
an episode row is recorded (and streamed) only by the first writer, the report is published
(and the trainer woken) only once. Values and stream entries are encoded by `rollout_wire.codec`,
the same codec the trainer's client reads them with.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from rollout_wire import codec
from rollout_wire import constants as k
from rollout_wire.redis_url import redis_client
from rollout_wire.rows import EpisodeRow

_CREATE_RECEIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: episodes, logs, stream; ARGV: index, row, log, ttl, entry fields...
_RECORD_EPISODE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('XADD', KEYS[3], '*', unpack(ARGV, 5))
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# KEYS: report, stream; ARGV: report, ttl, entry fields...
_PUBLISH_REPORT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) == false then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: states, stream; ARGV: index, rank, ttl, entry fields... Only a state further on is
# recorded, so progress never goes back and each state is streamed once.
_PUBLISH_STATE = """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) <= old then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""


# KEYS: groups, stream, counted; ARGV: group id, group JSON, passes (0/1), wanted, ttl, entry
# fields... A group is streamed once; the first `wanted` passing groups are counted, atomically
# (concurrent collectors finishing groups at once never count one too many). Returns 0 (done
# before), 1 (published), 2 (published and counted), 3 (counted and the quota is now met).
_PUBLISH_GROUP = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
local counted, met = 0, 0
local wanted = tonumber(ARGV[4])
if ARGV[3] == '1' and wanted > 0 and redis.call('LLEN', KEYS[3]) < wanted then
  local n = redis.call('RPUSH', KEYS[3], ARGV[1])
  counted = 1
  if n == wanted then met = 1 end
end
redis.call('XADD', KEYS[2], '*', 'counted', counted, unpack(ARGV, 6))
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return 1 + counted + met
"""

# Delete a claim only if this copy still holds it (it may have expired and been taken since).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Take or renew a lease held by token ARGV[1] for ARGV[2] ms; 0 while another token holds it.
_CLAIM_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# The waker's look, one round trip: renew its lease (as _CLAIM_LEASE), then read what it acts
# on. KEYS: lease, parked, parked-ready, report, cancel flag.
_WAKER_LOOK = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return {0} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, redis.call('HKEYS', KEYS[2]), redis.call('SMEMBERS', KEYS[3]),
        redis.call('EXISTS', KEYS[4]), redis.call('EXISTS', KEYS[5])}
"""


@dataclass(frozen=True)
class WakerLook:
    """What the batch's waker sees at one look. `held` False: another waker holds the lease
    (nothing else was read)."""

    held: bool
    parked: list[int] = field(default_factory=list)
    until_ready: frozenset[int] = frozenset()
    reported: bool = False
    cancelled: bool = False


@dataclass(frozen=True)
class GroupPublished:
    published: bool  # this call streamed the group (False: it was streamed before)
    counted: bool  # ... and counted it towards the quota
    quota_met: bool  # ... and that made the quota: the rest of the batch is to be aborted


class Store:
    """The workers' view of Redis. Every method is safe to repeat."""

    def __init__(self, client: redis.Redis, ttl: int) -> None:
        self.redis = client
        self.ttl = ttl
        self._create_receipt = client.register_script(_CREATE_RECEIPT)
        self._record_episode = client.register_script(_RECORD_EPISODE)
        self._publish_report = client.register_script(_PUBLISH_REPORT)
        self._publish_state = client.register_script(_PUBLISH_STATE)
        self._release = client.register_script(_RELEASE)
        self._claim_lease = client.register_script(_CLAIM_LEASE)
        self._waker_look = client.register_script(_WAKER_LOOK)
        self._publish_group = client.register_script(_PUBLISH_GROUP)

    @classmethod
    def from_url(cls, url: str, ttl: int) -> Store:
        return cls(redis_client(url, health_check_interval=30), ttl)

    def wait_reachable(self, seconds: float) -> bool:
        """Wait (at most `seconds`) until Redis answers again: after a restart or a failover."""
        end = time.monotonic() + seconds
        while True:
            with contextlib.suppress(redis.RedisError):
                return bool(self.redis.ping())
            if time.monotonic() > end:
                return False
            time.sleep(0.5)

    def count_episodes(self, batch_id: str) -> int:
        """How many of the batch's episodes have their row."""
        return int(self.redis.hlen(k.episodes_key(batch_id)))

    # -- receipts: a hash of JSON fields, so updates never race on a whole document ----------
    def create_receipt(self, batch_id: str, fields: Mapping[str, Any]) -> bool:
        flat: list[Any] = []
        for name, value in codec.encode_fields(fields).items():
            flat += [name, value]
        return bool(self._create_receipt(keys=[k.receipt_key(batch_id)], args=[self.ttl, *flat]))

    def update_receipt(self, batch_id: str, fields: Mapping[str, Any]) -> None:
        key = k.receipt_key(batch_id)
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping=codec.encode_fields(fields))  # type: ignore[arg-type]
        pipe.expire(key, self.ttl)
        pipe.execute()

    def load_receipt(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(k.receipt_key(batch_id))
        return codec.decode_fields(raw) if raw else None

    # -- the run registry: proof of what each run created, outliving receipts --------------
    def register_run(self, batch_id: str, fields: Mapping[str, Any]) -> None:
        """Merge `fields` into the batch's registry entry (one JSON document per batch)."""
        entry = self.registered_run(batch_id) or {}
        self.redis.hset(k.RUNS_KEY, batch_id, codec.dumps(entry | dict(fields)))

    def registered_run(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.hget(k.RUNS_KEY, batch_id)
        return None if raw is None else codec.loads(raw)

    def registered_runs(self) -> dict[str, dict[str, Any]]:
        return {
            name.decode(): codec.loads(value)
            for name, value in self.redis.hgetall(k.RUNS_KEY).items()
        }

    def forget_run(self, batch_id: str) -> None:
        self.redis.hdel(k.RUNS_KEY, batch_id)

    # -- episodes ----------------------------------------------------------------------------
    def register_pool(self, key: str, fields: Mapping[str, Any]) -> None:
        """Merge `fields` into a warm pool's registry entry (what it created, when used)."""
        raw = self.redis.hget(k.POOLS_KEY, key)
        entry = {} if raw is None else codec.loads(raw)
        self.redis.hset(k.POOLS_KEY, key, codec.dumps(entry | dict(fields)))

    def registered_pools(self) -> dict[str, dict[str, Any]]:
        return {
            name.decode(): codec.loads(value)
            for name, value in self.redis.hgetall(k.POOLS_KEY).items()
        }

    def forget_pool(self, key: str) -> None:
        self.redis.hdel(k.POOLS_KEY, key)

    def record_episode(self, batch_id: str, row: EpisodeRow, log: str) -> bool:
        """Store the row and log of an episode; False if this episode was recorded before."""
        row_json = codec.dumps(row.to_dict())
        keys = [k.episodes_key(batch_id), k.logs_key(batch_id), k.stream_key(batch_id)]
        args = [row.index, row_json, log, self.ttl, *codec.episode_entry(row.index, row_json)]
        return bool(self._record_episode(keys=keys, args=args))

    def record_trajectory(self, batch_id: str, index: int, trajectory: Mapping[str, Any]) -> bool:
        """Store an episode's trajectory once (the first writer wins, like its row)."""
        key = k.trajectories_key(batch_id)
        pipe = self.redis.pipeline()
        pipe.hsetnx(key, str(index), codec.dumps(trajectory))
        pipe.expire(key, self.ttl)
        created, _ = pipe.execute()
        return bool(created)

    def has_episode(self, batch_id: str, index: int) -> bool:
        return bool(self.redis.hexists(k.episodes_key(batch_id), str(index)))

    def recorded(self, batch_id: str) -> set[int]:
        """The indexes of the episodes that have their row (one read for the whole batch)."""
        return {int(i) for i in self.redis.hkeys(k.episodes_key(batch_id))}

    def episode_rows(self, batch_id: str) -> list[EpisodeRow]:
        raw = self.redis.hgetall(k.episodes_key(batch_id))
        return [EpisodeRow.from_dict(codec.loads(value)) for value in raw.values()]

    def rows_of(self, batch_id: str, indexes: Sequence[int]) -> dict[int, EpisodeRow]:
        """The rows recorded so far among `indexes` (one group's samples)."""
        raw = self.redis.hmget(k.episodes_key(batch_id), [str(i) for i in indexes])
        return {
            i: EpisodeRow.from_dict(codec.loads(value))
            for i, value in zip(indexes, raw, strict=True)
            if value is not None
        }

    # -- groups and the quota ----------------------------------------------------------------
    def publish_group(
        self, batch_id: str, group: Mapping[str, Any], passes: bool, wanted: int
    ) -> GroupPublished:
        """Stream a group whose samples all have their row, once; count it towards the quota
        (`wanted` groups that pass) when it passes and the quota is not met yet."""
        group_id, group_json = str(group["group_id"]), codec.dumps(dict(group))
        keys = [k.groups_key(batch_id), k.stream_key(batch_id), k.counted_key(batch_id)]
        args = [group_id, group_json, int(passes), wanted, self.ttl]
        done = int(
            self._publish_group(keys=keys, args=[*args, *codec.group_entry(group_id, group_json)])
        )
        return GroupPublished(published=done > 0, counted=done >= 2, quota_met=done == 3)

    def has_group(self, batch_id: str, group_id: str) -> bool:
        return bool(self.redis.hexists(k.groups_key(batch_id), group_id))

    def counted_groups(self, batch_id: str) -> list[str]:
        return [g.decode() for g in self.redis.lrange(k.counted_key(batch_id), 0, -1)]

    def policy_version(self, trainer: str) -> str | None:
        """The version the trainer published last (`RolloutClient.publish_policy_version`)."""
        raw = self.redis.get(k.policy_version_key(trainer))
        return None if raw is None else raw.decode()

    def _take_lease(self, key: str, token: str, ttl: float) -> bool:
        return bool(self._claim_lease(keys=[key], args=[token, int(ttl * 1000)]))

    def claim_dispatch(self, batch_id: str, token: str, ttl: float) -> bool:
        """Be (or stay) the one copy of the batch's submit that sends its chord, for `ttl`
        seconds; False while another holds it."""
        return self._take_lease(k.dispatching_key(batch_id), token, ttl)

    def drop_dispatch(self, batch_id: str, token: str) -> None:
        self._release(keys=[k.dispatching_key(batch_id)], args=[token])

    # -- one collecting copy per episode -----------------------------------------------------
    def claim_collect(self, batch_id: str, index: int, token: str, ttl: float) -> bool:
        """Take episode `index`'s collecting claim for `ttl` seconds; False if another copy
        holds it."""
        key = k.collecting_key(batch_id, index)
        return bool(self.redis.set(key, token, nx=True, px=int(ttl * 1000)))

    def collecting(self, batch_id: str, indexes: Sequence[int]) -> set[int]:
        """Those of `indexes` a collector is on now (its claim is held)."""
        if not indexes:
            return set()
        held = self.redis.mget([k.collecting_key(batch_id, i) for i in indexes])
        return {i for i, token in zip(indexes, held, strict=True) if token is not None}

    def count_collect_copy(self, batch_id: str) -> None:
        pipe = self.redis.pipeline()
        pipe.incr(k.collect_copies_key(batch_id))
        pipe.expire(k.collect_copies_key(batch_id), self.ttl)
        pipe.execute()

    def release_collect(self, batch_id: str, index: int, token: str) -> None:
        """Best effort: a claim not released (Redis away for a moment) expires on its own,
        and the error must not replace the task's own outcome."""
        with contextlib.suppress(redis.RedisError):
            self._release(keys=[k.collecting_key(batch_id, index)], args=[token])

    # -- parked collectors (core/park.py) ----------------------------------------------------
    def park(self, batch_id: str, index: int, message: str, until_ready: bool) -> None:
        parked, ready = k.parked_key(batch_id), k.parked_until_ready_key(batch_id)
        pipe = self.redis.pipeline(transaction=True)
        if until_ready:
            pipe.sadd(ready, index)
        else:
            pipe.srem(ready, index)
        pipe.hset(parked, str(index), message)
        pipe.expire(parked, self.ttl)
        pipe.expire(ready, self.ttl)
        pipe.execute()

    def parked(self, batch_id: str) -> tuple[list[int], set[int]]:
        """The parked episodes, and those of them waited on until ready only."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hkeys(k.parked_key(batch_id))
        pipe.smembers(k.parked_until_ready_key(batch_id))
        indexes, ready = pipe.execute()
        return sorted(int(i) for i in indexes), {int(i) for i in ready}

    def unpark(self, batch_id: str, index: int) -> str | None:
        """Take episode `index`'s parked message: exactly one caller gets it."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hget(k.parked_key(batch_id), str(index))
        pipe.hdel(k.parked_key(batch_id), str(index))
        pipe.srem(k.parked_until_ready_key(batch_id), index)
        message, deleted, _ = pipe.execute()
        return message.decode() if deleted and message is not None else None

    def claim_waker(self, batch_id: str, token: str, ttl: float) -> bool:
        """Be (or stay) the batch's waker for `ttl` seconds; False while another holds it."""
        return self._take_lease(k.waker_key(batch_id), token, ttl)

    def waker_look(self, batch_id: str, token: str, ttl: float, flag: str) -> WakerLook:
        """`claim_waker`, then the parked episodes, the report and the batch's `flag` (its
        cancel flag), in one round trip: the waker looks every 1-3 s for a batch's whole wall."""
        keys = [
            k.waker_key(batch_id),
            k.parked_key(batch_id),
            k.parked_until_ready_key(batch_id),
            k.report_key(batch_id),
            k.flag_key(batch_id, flag),
        ]
        found = self._waker_look(keys=keys, args=[token, int(ttl * 1000)])
        if not found[0]:
            return WakerLook(held=False)
        _, indexes, ready, reported, flagged = found
        return WakerLook(
            held=True,
            parked=sorted(int(i) for i in indexes),
            until_ready=frozenset(int(i) for i in ready),
            reported=bool(reported),
            cancelled=bool(flagged),
        )

    def drop_waker(self, batch_id: str, token: str) -> None:
        self._release(keys=[k.waker_key(batch_id)], args=[token])

    def publish_state(self, batch_id: str, index: int, state: str) -> bool:
        """Stream an episode's progress (running, ready, rewarded) once per state."""
        keys = [k.states_key(batch_id), k.stream_key(batch_id)]
        args = [index, k.STATES.index(state), self.ttl, *codec.state_entry(index, state)]
        return bool(self._publish_state(keys=keys, args=args))

    # -- the circuit breaker -----------------------------------------------------------------
    def note_outcome(self, batch_id: str, failure: Mapping[str, Any] | None) -> list[Any]:
        """Count an episode's outcome towards its batch's infrastructure failures in a row:
        `failure` (its index and cause) extends the streak, None ends it. Returns the streak,
        oldest first (atomic: concurrent collectors each see their own length)."""
        key = k.infra_streak_key(batch_id)
        pipe = self.redis.pipeline()
        if failure is None:
            pipe.delete(key)
            pipe.execute()
            return []
        pipe.rpush(key, codec.dumps(dict(failure)))
        pipe.expire(key, self.ttl)
        length, _ = pipe.execute()
        return [codec.loads(item) for item in self.redis.lrange(key, 0, int(length) - 1)]

    # -- records and report ------------------------------------------------------------------
    def save_records(self, batch_id: str, records: Mapping[str, str]) -> None:
        if records:
            key = k.artifacts_key(batch_id)
            pipe = self.redis.pipeline()
            pipe.hset(key, mapping=dict(records))  # type: ignore[arg-type]
            pipe.expire(key, self.ttl)
            pipe.execute()

    def publish_report(self, batch_id: str, report: Mapping[str, Any]) -> bool:
        keys = [k.report_key(batch_id), k.stream_key(batch_id)]
        status = str(report.get("status", ""))
        args = [codec.dumps(report), self.ttl, *codec.report_entry(status)]
        return bool(self._publish_report(keys=keys, args=args))

    def report(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(k.report_key(batch_id))
        return None if raw is None else codec.loads(raw)

    def has_report(self, batch_id: str) -> bool:
        return bool(self.redis.exists(k.report_key(batch_id)))

    def set_flag(self, batch_id: str, name: str) -> None:
        self.redis.set(k.flag_key(batch_id, name), 1, ex=self.ttl)

    def has_flag(self, batch_id: str, name: str) -> bool:
        return bool(self.redis.exists(k.flag_key(batch_id, name)))

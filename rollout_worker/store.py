"""Redis storage for receipts, episode rows, logs, records and reports.

Each write that must happen once is a Lua script, so a redelivered task can repeat it freely:
an episode row is recorded (and streamed) only by the first writer, the report is published
(and the trainer woken) only once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import redis

from rollout_worker import constants as k
from rollout_worker.models import EpisodeRow

_CREATE_RECEIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS: episodes, logs, stream; ARGV: index, row, log, ttl
_RECORD_EPISODE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('XADD', KEYS[3], '*', 'type', 'episode', 'index', ARGV[1], 'row', ARGV[2])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# KEYS: report, stream; ARGV: report, ttl, status
_PUBLISH_REPORT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) == false then return 0 end
redis.call('XADD', KEYS[2], '*', 'type', 'report', 'status', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""


# KEYS: states, stream; ARGV: index, state, rank, ttl. Only a state further on is recorded.
_PUBLISH_STATE = """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[3]) <= old then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('XADD', KEYS[2], '*', 'type', 'state', 'index', ARGV[1], 'state', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""


DONE_SIGNAL_TTL = 3600


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


class Store:
    def __init__(self, client: redis.Redis, ttl: int) -> None:
        self.redis = client
        self.ttl = ttl
        self._create_receipt = client.register_script(_CREATE_RECEIPT)
        self._record_episode = client.register_script(_RECORD_EPISODE)
        self._publish_report = client.register_script(_PUBLISH_REPORT)
        self._publish_state = client.register_script(_PUBLISH_STATE)

    @classmethod
    def from_url(cls, url: str, ttl: int) -> Store:
        return cls(redis.Redis.from_url(url, health_check_interval=30), ttl)

    # -- receipts: a hash of JSON fields, so updates never race on a whole document ----------
    def create_receipt(self, batch_id: str, fields: dict[str, Any]) -> bool:
        flat: list[Any] = []
        for name, value in fields.items():
            flat += [name, dumps(value)]
        return bool(self._create_receipt(keys=[k.receipt_key(batch_id)], args=[self.ttl, *flat]))

    def update_receipt(self, batch_id: str, fields: dict[str, Any]) -> None:
        key = k.receipt_key(batch_id)
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping={name: dumps(value) for name, value in fields.items()})
        pipe.expire(key, self.ttl)
        pipe.execute()

    def load_receipt(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(k.receipt_key(batch_id))
        if not raw:
            return None
        return {name.decode(): orjson.loads(value) for name, value in raw.items()}

    # -- episodes ----------------------------------------------------------------------------
    def record_episode(self, batch_id: str, row: EpisodeRow, log: str) -> bool:
        """Store the row and log of an episode; False if this episode was recorded before."""
        keys = [k.episodes_key(batch_id), k.logs_key(batch_id), k.stream_key(batch_id)]
        args = [row.index, dumps(row.to_dict()), log, self.ttl]
        return bool(self._record_episode(keys=keys, args=args))

    def has_episode(self, batch_id: str, index: int) -> bool:
        return bool(self.redis.hexists(k.episodes_key(batch_id), str(index)))

    def episode_rows(self, batch_id: str) -> list[EpisodeRow]:
        raw = self.redis.hgetall(k.episodes_key(batch_id))
        return [EpisodeRow.from_dict(orjson.loads(value)) for value in raw.values()]

    def publish_state(self, batch_id: str, index: int, state: str) -> bool:
        """Stream an episode's progress (running, ready, rewarded) once per state."""
        rank = k.STATES.index(state)
        keys = [k.states_key(batch_id), k.stream_key(batch_id)]
        return bool(self._publish_state(keys=keys, args=[index, state, rank, self.ttl]))

    def signal_done(self, batch_id: str, index: int) -> None:
        key = k.done_key(batch_id, index)
        pipe = self.redis.pipeline()
        pipe.rpush(key, 1)
        pipe.expire(key, DONE_SIGNAL_TTL)  # a signal nobody consumed is useless after that
        pipe.execute()

    def wait_done(self, batch_id: str, index: int, timeout: float) -> bool:
        """Block until episode `index` is signalled done, at most `timeout` seconds."""
        return self.redis.blpop([k.done_key(batch_id, index)], timeout=timeout) is not None

    # -- records and report ------------------------------------------------------------------
    def save_records(self, batch_id: str, records: Mapping[str, str]) -> None:
        if records:
            key = k.artifacts_key(batch_id)
            self.redis.hset(key, mapping=dict(records.items()))
            self.redis.expire(key, self.ttl)

    def publish_report(self, batch_id: str, report: dict[str, Any]) -> bool:
        keys = [k.report_key(batch_id), k.stream_key(batch_id)]
        return bool(
            self._publish_report(
                keys=keys, args=[dumps(report), self.ttl, report.get("status", "")]
            )
        )

    def report(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(k.report_key(batch_id))
        return None if raw is None else orjson.loads(raw)

    def has_report(self, batch_id: str) -> bool:
        return bool(self.redis.exists(k.report_key(batch_id)))

    def set_flag(self, batch_id: str, name: str) -> None:
        self.redis.set(k.flag_key(batch_id, name), 1, ex=self.ttl)

    def has_flag(self, batch_id: str, name: str) -> bool:
        return bool(self.redis.exists(k.flag_key(batch_id, name)))

"""The Redis protocol between HostBackend (Celery side) and the host agents.

A batch's episodes reach hosts through one global list of `batch:index` items. ENQUEUE releases
`min(parallelism, count)` indexes and every FINISH releases the next one, so a batch's
parallelism holds across all hosts as the local supervisor holds it on one machine. A host
BLMOVEs an item to its own `taking` list (nothing is lost if it dies there), then TAKE (Lua)
drops what must not run (batch gone, stopped, past its deadline, already ended) or leases it.
Every host write is fenced on the lease's token: a host whose lease was reaped writes nothing.
REAP puts an expired lease's episode back at the head of the list while `infra_retries`
allows (`HostLost`), else ends it `Failed/HostLost`. Each multi-key step is one Lua script.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from rollout_wire import constants as k
from rollout_worker.backends.base import MAX_LOG_BYTES

LEASE_SECONDS = 15.0  # a host that has not renewed for this long lost its episodes
RENEW_SECONDS = 2.0  # how often a host renews all its leases (LEASE_SECONDS / RENEW >= 3)
HEARTBEAT_SECONDS = 15.0  # a host's heartbeat expires after this
# The flag core.state.FLAG_CANCEL sets (the core is a floor above: the name is repeated here,
# and a test checks both agree).
CANCEL_FLAG = "cancel"
HOST_LOST = "HostLost"
# A host that put back an item of another program's batch waits this long before its next take.
SKEW_PAUSE_SECONDS = 0.5
DONE_TTL = 3600  # as local/signal.SIGNAL_TTL

# Per-batch keys are built inside the scripts (TAKE learns the batch from the item it pops):
# HEAD .. batch .. TAIL .. part is k.batch_key(batch, part).
_HEAD, _TAIL = k.batch_key("\0", "").split("\0")

_COMMON = f"""
local HEAD, TAIL, TODO = '{_HEAD}', '{_TAIL}', '{k.HOSTS_TODO_KEY}'
-- One entry per episode released and not ended: what the hosts have to do (KEDA scales on it).
local DEMAND = '{k.HOSTS_DEMAND_KEY}'
local function ended(b, i) redis.call('LREM', DEMAND, 1, b .. ':' .. i) end
local function key(b, part) return HEAD .. b .. TAIL .. part end
local function hkey(b, part) return key(b, 'host:' .. part) end
local function stopped(b)
  return redis.call('HGET', hkey(b, 'run'), 'stopped') == '1'
    or redis.call('EXISTS', key(b, 'flag:{CANCEL_FLAG}')) == 1
end
local function notify(b, i)
  local d = key(b, 'done:' .. i)
  redis.call('RPUSH', d, 1)
  redis.call('EXPIRE', d, {DONE_TTL})
end
-- Release the batch's next index (one episode ended: the batch may start one more).
local function release(b)
  local run = hkey(b, 'run')
  if stopped(b) then return end
  local released = tonumber(redis.call('HGET', run, 'released'))
  local count = tonumber(redis.call('HGET', run, 'count'))
  if released and count and released < count then
    redis.call('HSET', run, 'released', released + 1)
    redis.call('RPUSH', TODO, b .. ':' .. released)
    redis.call('RPUSH', DEMAND, b .. ':' .. released)
  end
end
-- End episode i with a status nobody ran (deadline, host lost): as the local supervisor
-- writes a pending episode's. Returns 1 when this call wrote it.
local function fail(b, i, reason, node, now)
  local run = hkey(b, 'run')
  local prefix = redis.call('HGET', run, 'episode_prefix') or b
  local image = redis.call('HGET', run, 'image_id') or ''
  local retried = redis.call('HGET', hkey(b, 'attempts'), tostring(i)) or '[]'
  local n = #cjson.decode(retried)
  local id = prefix .. '-' .. i
  if n > 0 then id = id .. '-retry' .. n end
  local body = cjson.encode({{index = tonumber(i), episode_id = id, node = node,
    image_id = image, restart_count = 0, phase = 'Failed', reason = reason,
    exit_code = cjson.null, finished_at = tonumber(now)}})
  body = string.sub(body, 1, -2) .. ',"retried":' .. retried .. '}}'
  if redis.call('HSETNX', hkey(b, 'status'), tostring(i), body) == 1 then
    ended(b, i)
    notify(b, i)
    return 1
  end
  return 0
end
"""

# KEYS: run hash, runs registry. ARGV: batch, run_uid, doc, count, parallelism, deadline_at,
# infra_retries, episode_prefix, image_id, now, program_sha.
_ENQUEUE = (
    _COMMON
    + """
local b = ARGV[1]
if redis.call('HSETNX', KEYS[1], 'run_uid', ARGV[2]) == 0 then return 0 end
local count, par = tonumber(ARGV[4]), math.max(1, tonumber(ARGV[5]))
local n = math.min(count, par)
redis.call('HSET', KEYS[1], 'doc', ARGV[3], 'count', count, 'parallelism', par,
  'deadline_at', ARGV[6], 'infra_retries', ARGV[7], 'episode_prefix', ARGV[8],
  'image_id', ARGV[9], 'released', n, 'created_at', ARGV[10], 'program_sha', ARGV[11])
redis.call('HSET', KEYS[2], b, cjson.encode({run_uid = ARGV[2], created_at = tonumber(ARGV[10])}))
for i = 0, n - 1 do
  redis.call('RPUSH', TODO, b .. ':' .. i)
  redis.call('RPUSH', DEMAND, b .. ':' .. i)
end
return 1
"""
)

# KEYS: the host's taking list. ARGV: item, host, token, now, lease ms, the host's program sha.
# Returns {batch, index, attempt} when leased; 0 when the batch expects another episode program
# (a rolling update): the item goes back to the list's tail, untouched, for a host that runs
# that program (none: the batch's deadline ends it); else false (the item is dropped).
_TAKE = (
    _COMMON
    + """
local item, host, token, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
redis.call('LREM', KEYS[1], 1, item)
local b, i = string.match(item, '^(.*):(%d+)$')
if not b then return false end
local run = hkey(b, 'run')
-- Dropped: it will never run (nor end), so it is no demand either.
if redis.call('EXISTS', run) == 0 or stopped(b) then ended(b, i) return false end
if redis.call('HEXISTS', hkey(b, 'status'), i) == 1 then ended(b, i) return false end
if redis.call('HEXISTS', hkey(b, 'taken'), i) == 1 then return false end
if now >= tonumber(redis.call('HGET', run, 'deadline_at')) then
  if fail(b, i, 'DeadlineExceeded', '', now) == 1 then release(b) end
  return false
end
local want = redis.call('HGET', run, 'program_sha')
if ARGV[6] ~= '' and want and want ~= '' and want ~= ARGV[6] then
  redis.call('RPUSH', TODO, item)
  return 0
end
local attempts = redis.call('HGET', hkey(b, 'attempts'), i)
local attempt = 0
if attempts then attempt = #cjson.decode(attempts) end
redis.call('HSET', hkey(b, 'taken'), i,
  cjson.encode({host = host, token = token, attempt = attempt, at = now}))
redis.call('SET', hkey(b, 'lease:' .. i), token, 'PX', ARGV[5])
return {b, tonumber(i), attempt}
"""
)

# ARGV: lease ms, then (batch, index, token) per lease. Returns the positions (1-based) of
# the leases lost: their `taken` entry is another's or gone (reaped, finished, deleted).
_RENEW = (
    _COMMON
    + """
local lost = {}
for n = 2, #ARGV, 3 do
  local b, i, token = ARGV[n], ARGV[n + 1], ARGV[n + 2]
  local t = redis.call('HGET', hkey(b, 'taken'), i)
  if t and cjson.decode(t).token == token then
    redis.call('SET', hkey(b, 'lease:' .. i), token, 'PX', ARGV[1])
  else
    table.insert(lost, (n + 1) / 3)
  end
end
return lost
"""
)

# ARGV: batch, index, token, status JSON, log, then (name, bytes) per record.
# Returns 1 when written, 0 when the lease was lost (nothing written).
_FINISH = (
    _COMMON
    + """
local b, i, token = ARGV[1], ARGV[2], ARGV[3]
local t = redis.call('HGET', hkey(b, 'taken'), i)
if not t or cjson.decode(t).token ~= token then return 0 end
redis.call('HDEL', hkey(b, 'taken'), i)
redis.call('DEL', hkey(b, 'lease:' .. i))
ended(b, i)
if redis.call('HSETNX', hkey(b, 'status'), i, ARGV[4]) == 1 then
  redis.call('SET', hkey(b, 'log:' .. i), ARGV[5])
  for n = 6, #ARGV, 2 do redis.call('HSET', hkey(b, 'records'), ARGV[n], ARGV[n + 1]) end
end
notify(b, i)
release(b)
return 1
"""
)

# KEYS: the batch's taken and attempts hashes. ARGV: batch, index, token, attempts JSON. The
# episode's attempts after its host retried it (exit 4), so a host that takes it next knows
# them. Returns 0 (nothing written) when the lease was lost.
_ATTEMPTS = """
local t = redis.call('HGET', KEYS[1], ARGV[2])
if not t or cjson.decode(t).token ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
return 1
"""

# ARGV: batch, now. Returns the indexes put back on the list.
_REAP = (
    _COMMON
    + f"""
local b, now = ARGV[1], tonumber(ARGV[2])
-- Hosts whose heartbeat expired: what they moved off the list but never took goes back.
local alive = '{k.HOSTS_ALIVE_KEY}'
for _, host in ipairs(redis.call('HKEYS', alive)) do
  if redis.call('EXISTS', '{k.hosts_seen_key("")}' .. host) == 0 then
    local taking = '{k.hosts_taking_key("")}' .. host
    while redis.call('LMOVE', taking, TODO, 'RIGHT', 'LEFT') do end
    redis.call('HDEL', alive, host)
  end
end
local run = hkey(b, 'run')
if redis.call('EXISTS', run) == 0 then return {{}} end
local deadline = tonumber(redis.call('HGET', run, 'deadline_at'))
local retries = tonumber(redis.call('HGET', run, 'infra_retries'))
local status, taken, attempts = hkey(b, 'status'), hkey(b, 'taken'), hkey(b, 'attempts')
local requeued = {{}}
local entries = redis.call('HGETALL', taken)
for n = 1, #entries, 2 do
  local i, t = entries[n], cjson.decode(entries[n + 1])
  if redis.call('EXISTS', hkey(b, 'lease:' .. i)) == 0 then
    redis.call('HDEL', taken, i)
    if redis.call('HEXISTS', status, i) == 0 then
      local list = cjson.decode(redis.call('HGET', attempts, i) or '[]')
      local prefix = redis.call('HGET', run, 'episode_prefix') or b
      local id = prefix .. '-' .. i
      if #list > 0 then id = id .. '-retry' .. #list end
      local entry = cjson.encode({{reason = '{HOST_LOST}', host = t.host, at = now,
        episode_id = id, exit_code = cjson.null, finished_at = now,
        cause = 'host ' .. t.host .. ' stopped renewing its lease'}})
      if #list < retries and now < deadline and not stopped(b) then
        local raw = redis.call('HGET', attempts, i)
        if raw and raw ~= '[]' then
          raw = string.sub(raw, 1, -2) .. ',' .. entry .. ']'
        else
          raw = '[' .. entry .. ']'
        end
        redis.call('HSET', attempts, i, raw)
        redis.call('LPUSH', TODO, b .. ':' .. i)
        table.insert(requeued, tonumber(i))
      elseif fail(b, i, '{HOST_LOST}', t.host, now) == 1 then
        release(b)
      end
    end
  end
end
-- Past the deadline nothing more runs: end every episode no host holds.
if now >= deadline then
  local count = tonumber(redis.call('HGET', run, 'count'))
  for i = 0, count - 1 do
    if redis.call('HEXISTS', taken, tostring(i)) == 0 then
      fail(b, i, 'DeadlineExceeded', '', now)
    end
  end
  redis.call('HSET', run, 'released', count)
end
return requeued
"""
)

# KEYS: run hash, runs registry. ARGV: batch, run_uid. 1: deleted (or nothing left), 0: the
# run belongs to another uid.
_DELETE = (
    _COMMON
    + """
local b = ARGV[1]
local uid = redis.call('HGET', KEYS[1], 'run_uid')
if uid and uid ~= ARGV[2] then return 0 end
local count = tonumber(redis.call('HGET', KEYS[1], 'count') or '0')
local released = tonumber(redis.call('HGET', KEYS[1], 'released') or '0')
for i = 0, count - 1 do
  redis.call('DEL', hkey(b, 'log:' .. i), hkey(b, 'lease:' .. i))
  if i < released and redis.call('HEXISTS', hkey(b, 'status'), tostring(i)) == 0 then
    ended(b, i)
  end
end
redis.call('DEL', KEYS[1], hkey(b, 'status'), hkey(b, 'taken'), hkey(b, 'attempts'),
  hkey(b, 'records'))
redis.call('HDEL', KEYS[2], b)
return 1
"""
)

_STOP = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'stopped', '1') end
"""

# KEYS: a host's taking list, the todo list: put back what the host moved but never took.
_RECOVER = """
local n = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
return n
"""


@dataclass(frozen=True)
class Lease:
    """One taken episode."""

    batch: str
    index: int
    token: str  # unique per take; every host write is fenced on it
    attempt: int  # 0 first time, +1 per HostLost requeue


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


class HostQueue:
    def __init__(self, client: redis.Redis, lease_seconds: float = LEASE_SECONDS) -> None:
        self.redis = client
        self.lease_seconds = lease_seconds  # of the leases this client takes and renews
        self._enqueue = client.register_script(_ENQUEUE)
        self._take = client.register_script(_TAKE)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)
        self._reap = client.register_script(_REAP)
        self._delete = client.register_script(_DELETE)
        self._stop = client.register_script(_STOP)
        self._recover = client.register_script(_RECOVER)
        self._attempts = client.register_script(_ATTEMPTS)

    # -- Celery side -------------------------------------------------------------------------
    def enqueue(
        self,
        batch: str,
        run_uid: str,
        doc: bytes,
        count: int,
        parallelism: int,
        deadline_at: float,
        infra_retries: int,
    ) -> None:
        """Register the run and release its first indexes; a second call does nothing."""
        run = orjson.loads(doc)
        args = [batch, run_uid, doc, count, parallelism, repr(deadline_at), infra_retries]
        args += [str(run.get("episode_prefix") or batch), str(run.get("image_id") or "")]
        keys = [k.host_batch_key(batch, "run"), k.HOSTS_RUNS_KEY]
        created_at = float(run.get("created_at") or time.time())  # the run's origin
        sha = str(run.get("program_sha") or "")  # hosts of another program do not take it
        self._enqueue(keys=keys, args=[*args, repr(created_at), sha])

    def run_doc(self, batch: str) -> bytes | None:
        doc = self.redis.hget(k.host_batch_key(batch, "run"), "doc")
        return None if doc is None else _raw(doc)

    def run_info(self, batch: str) -> dict[str, str]:
        """The run's registration (run_uid, count, deadline_at, ...), without its document."""
        fields = self.redis.hgetall(k.host_batch_key(batch, "run"))
        return {_text(f): _text(v) for f, v in fields.items() if _text(f) != "doc"}

    def status(self, batch: str, index: int) -> dict[str, Any] | None:
        raw = self.redis.hget(k.host_batch_key(batch, "status"), str(index))
        return None if raw is None else dict(orjson.loads(raw))

    def statuses(self, batch: str) -> dict[int, dict[str, Any]]:
        raw = self.redis.hgetall(k.host_batch_key(batch, "status"))
        return {int(i): dict(orjson.loads(v)) for i, v in raw.items()}

    def ended(self, batch: str, indexes: list[int]) -> list[int] | None:
        """Those of `indexes` that have a status; None when the run is gone (deleted)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(k.host_batch_key(batch, "run"))
        for index in indexes:
            pipe.hexists(k.host_batch_key(batch, "status"), str(index))
        exists, *has = pipe.execute()
        if not exists:
            return None
        return [index for index, yes in zip(indexes, has, strict=True) if yes]

    def log(self, batch: str, index: int) -> bytes | None:
        raw = self.redis.get(k.host_batch_key(batch, f"log:{index}"))
        return None if raw is None else _raw(raw)

    def records(self, batch: str) -> dict[str, bytes]:
        raw = self.redis.hgetall(k.host_batch_key(batch, "records"))
        return {_text(name): _raw(value) for name, value in raw.items()}

    def taken(self, batch: str) -> dict[int, str]:
        raw = self.redis.hgetall(k.host_batch_key(batch, "taken"))
        return {int(i): str(orjson.loads(v)["host"]) for i, v in raw.items()}

    def reap(self, batch: str) -> list[int]:
        """Requeue (or end as HostLost) the episodes whose host stopped renewing; past the
        deadline, end every episode no host holds. Returns the indexes requeued."""
        return [int(i) for i in self._reap(args=[batch, repr(time.time())])]

    def stop(self, batch: str) -> None:
        """Cancel: nothing more of the batch is taken; hosts kill what they run of it."""
        # A run never registered (or deleted) gets no half hash with only `stopped` in it.
        self._stop(keys=[k.host_batch_key(batch, "run")])

    def delete(self, batch: str, run_uid: str) -> bool:
        """Remove every key of the run, only if it is `run_uid`'s."""
        keys = [k.host_batch_key(batch, "run"), k.HOSTS_RUNS_KEY]
        return bool(self._delete(keys=keys, args=[batch, run_uid]))

    def runs(self) -> dict[str, dict[str, Any]]:
        raw = self.redis.hgetall(k.HOSTS_RUNS_KEY)
        return {_text(b): dict(orjson.loads(v)) for b, v in raw.items()}

    def hosts(self) -> dict[str, dict[str, Any]]:
        """The live hosts' last heartbeats."""
        beats = {
            _text(h): dict(orjson.loads(v))
            for h, v in self.redis.hgetall(k.HOSTS_ALIVE_KEY).items()
        }
        if not beats:
            return {}
        pipe = self.redis.pipeline()
        for host in beats:
            pipe.exists(k.hosts_seen_key(host))
        live = pipe.execute()
        return {h: info for (h, info), up in zip(beats.items(), live, strict=True) if up}

    # -- host side ---------------------------------------------------------------------------
    def take(self, host: str, timeout: float, program_sha: str = "") -> Lease | None:
        """Block up to `timeout` for an episode to run; None when nothing came. With the
        host's `program_sha`, an episode of a batch that expects another program is put back
        (no retry spent) and this host pauses SKEW_PAUSE_SECONDS before the next item, so a
        host of that program takes it meanwhile."""
        end = time.monotonic() + timeout
        taking = k.hosts_taking_key(host)
        while True:
            remaining = end - time.monotonic()
            # BLMOVE's timeout is a float in seconds; 0 would block forever.
            item = self.redis.blmove(
                k.HOSTS_TODO_KEY, taking, max(0.01, remaining), "LEFT", "RIGHT"
            )
            if item is not None:
                token = secrets.token_hex(16)
                args = [item, host, token, repr(time.time()), int(self.lease_seconds * 1000)]
                got = self._take(keys=[taking], args=[*args, program_sha])
                if got == 0:
                    time.sleep(max(0.0, min(SKEW_PAUSE_SECONDS, end - time.monotonic())))
                elif got:
                    return Lease(_text(got[0]), int(got[1]), token, int(got[2]))
            if time.monotonic() >= end:
                return None

    def renew(self, host: str, leases: list[Lease]) -> list[Lease]:
        """Extend the host's leases; returns the ones it lost (kill those sandboxes)."""
        del host  # the token says whose lease it is
        if not leases:
            return []
        args: list[Any] = [int(self.lease_seconds * 1000)]
        for lease in leases:
            args += [lease.batch, lease.index, lease.token]
        lost = self._renew(args=args)
        return [leases[int(n) - 1] for n in lost]

    def finish(
        self,
        lease: Lease,
        status: dict[str, Any],
        log: bytes,
        records: dict[str, bytes] | None = None,
    ) -> bool:
        """Record the episode's end; False (nothing written) when the lease was lost."""
        args: list[Any] = [lease.batch, lease.index, lease.token, orjson.dumps(status)]
        args.append(log[:MAX_LOG_BYTES])
        for name, data in (records or {}).items():
            args += [name, data]
        return bool(self._finish(args=args))

    def record_attempts(self, lease: Lease, retried: list[dict[str, Any]]) -> bool:
        """The episode's attempts so far, after a retry on its host (fenced on the lease): the
        retry budget and the next sandbox's name hold if the host is lost next."""
        keys = [k.host_batch_key(lease.batch, "taken"), k.host_batch_key(lease.batch, "attempts")]
        args = [lease.batch, lease.index, lease.token, orjson.dumps(retried)]
        return bool(self._attempts(keys=keys, args=args))

    def attempts(self, batch: str, index: int) -> list[dict[str, Any]]:
        raw = self.redis.hget(k.host_batch_key(batch, "attempts"), str(index))
        return [] if raw is None else list(orjson.loads(raw))

    def all_attempts(self, batch: str) -> dict[int, list[dict[str, Any]]]:
        raw = self.redis.hgetall(k.host_batch_key(batch, "attempts"))
        return {int(i): list(orjson.loads(v)) for i, v in raw.items()}

    def untaken(self, batch: str) -> int:
        """The batch's episodes that no host holds and that have not ended: on the list, put
        back after a lost host, or not yet released (0 once the run is gone). A host keeps
        no more sandboxes of the batch waiting than this."""
        pipe = self.redis.pipeline()
        pipe.hget(k.host_batch_key(batch, "run"), "count")
        pipe.hlen(k.host_batch_key(batch, "status"))
        pipe.hlen(k.host_batch_key(batch, "taken"))
        count, ended, taken = pipe.execute()
        return max(0, int(count or 0) - int(ended) - int(taken))

    def stopped(self, batch: str) -> bool:
        """Cancelled or deleted: a host kills what it runs of this batch."""
        pipe = self.redis.pipeline()
        pipe.hget(k.host_batch_key(batch, "run"), "stopped")
        pipe.exists(k.host_batch_key(batch, "run"))
        pipe.exists(k.flag_key(batch, CANCEL_FLAG))
        flag, exists, cancelled = pipe.execute()
        return flag is not None or not exists or bool(cancelled)

    def heartbeat(self, host: str, info: dict[str, Any]) -> None:
        pipe = self.redis.pipeline()
        pipe.hset(k.HOSTS_ALIVE_KEY, host, orjson.dumps({**info, "seen_at": time.time()}))
        pipe.set(k.hosts_seen_key(host), 1, px=int(HEARTBEAT_SECONDS * 1000))
        pipe.execute()

    def recover(self, host: str) -> int:
        """At a host's start: what its previous life moved off the list but never took goes
        back to the head of the list. Returns how many items."""
        return int(self._recover(keys=[k.hosts_taking_key(host), k.HOSTS_TODO_KEY]))

    def leave(self, host: str) -> None:
        """A host that exits cleanly says so at once (instead of its heartbeat expiring)."""
        pipe = self.redis.pipeline()
        pipe.hdel(k.HOSTS_ALIVE_KEY, host)
        pipe.delete(k.hosts_seen_key(host))
        pipe.execute()

"""Every queue name, task name, Redis key, stream field and label the system uses.

Both sides (workers and the trainer) read these; changing one is a wire-format change.
"""

from __future__ import annotations

from rollout_wire.states import Progress

# Queues: `control` runs short orchestration tasks; `collect` runs one task per episode and is
# scaled by starting more workers on it.
QUEUE_CONTROL = "control"
QUEUE_COLLECT = "collect"
QUEUES = (QUEUE_CONTROL, QUEUE_COLLECT)
# Message priorities on the collect queue (Redis: a list per priority step, read lowest number
# first). A batch's first collect messages go last; a parked collector sent again once its
# episode ended goes first, so it never waits behind collectors of episodes not started yet.
PRIORITY_FIRST_COLLECT = 9
PRIORITY_RESENT = 0

# Task names are explicit so the trainer can send tasks by name without importing the worker.
TASK_SUBMIT = "rollout.submit_batch"
TASK_COLLECT = "rollout.collect_episode"
TASK_AGGREGATE = "rollout.aggregate_batch"
TASK_WATCHDOG = "rollout.batch_watchdog"
TASK_CLEANUP = "rollout.cleanup_run"
TASK_CANCEL = "rollout.cancel_batch"
TASK_SWEEP = "rollout.sweep"
TASK_FILL_POOL = "rollout.fill_pool"
TASK_FEED = "rollout.feed_batch"
TASK_WAKE = "rollout.wake_batch"
TASKS = (
    TASK_SUBMIT,
    TASK_COLLECT,
    TASK_AGGREGATE,
    TASK_WATCHDOG,
    TASK_CLEANUP,
    TASK_CANCEL,
    TASK_SWEEP,
    TASK_FILL_POOL,
    TASK_FEED,
    TASK_WAKE,
)

KEY_PREFIX = "rollout"


# Hash batch id -> JSON proof of what its run created (the receipt's run fields). Written with
# the receipt, before the first mutation; kept until the run is deleted, even after the
# receipt expires, so the sweeper can prove (by UID) what it deletes.
RUNS_KEY = f"{KEY_PREFIX}:runs"


def batch_key(batch_id: str, part: str) -> str:
    return f"{KEY_PREFIX}:batch:{batch_id}:{part}"


def receipt_key(batch_id: str) -> str:
    """JSON receipt: what was asked and what was created (written before any mutation)."""
    return batch_key(batch_id, "receipt")


def episodes_key(batch_id: str) -> str:
    """Hash index -> episode row JSON; HSETNX makes each episode count exactly once."""
    return batch_key(batch_id, "episodes")


def logs_key(batch_id: str) -> str:
    """Hash index -> the episode's raw log (its stdout), kept as the episode's record."""
    return batch_key(batch_id, "logs")


def trajectories_key(batch_id: str) -> str:
    """Hash index -> the episode's trajectory (JSON: steps and outcome, see
    rollout_wire.trajectory), written with its row; the trainer reads it per episode."""
    return batch_key(batch_id, "trajectories")


def artifacts_key(batch_id: str) -> str:
    """Hash name -> backend records (job.json, pods.json, events.txt, ...)."""
    return batch_key(batch_id, "artifacts")


def report_key(batch_id: str) -> str:
    """The final batch report (JSON), written once."""
    return batch_key(batch_id, "report")


def stream_key(batch_id: str) -> str:
    """Per-batch stream: one entry per collected episode, then one `report` entry.

    A stream (not pub/sub) so a trainer that subscribes late still sees every entry.
    """
    return batch_key(batch_id, "events")


def done_key(batch_id: str, index: int) -> str:
    """List the local supervisor pushes to when episode `index` has its status (wakes a
    collector blocked on it, instead of it polling the file)."""
    return batch_key(batch_id, f"done:{index}")


def collecting_key(batch_id: str, index: int) -> str:
    """Held (with a TTL) by the one copy of episode `index`'s collect task that is collecting
    it; a redelivered copy waits instead of watching and reading the same episode again."""
    return batch_key(batch_id, f"collecting:{index}")


def parked_key(batch_id: str) -> str:
    """Hash index -> the collect message (JSON) of an episode parked until it ends."""
    return batch_key(batch_id, "parked")


def parked_until_ready_key(batch_id: str) -> str:
    """Set of the parked episodes whose waker sends them again once ready (to stream it)."""
    return batch_key(batch_id, "parked-ready")


def dispatching_key(batch_id: str) -> str:
    """Held (with a TTL) by the copy of a batch's submit that is sending its chord: a copy
    redelivered meanwhile (a long dispatch outlived the visibility timeout) waits for it."""
    return batch_key(batch_id, "dispatching")


def waker_key(batch_id: str) -> str:
    """Set while the batch's waker runs (it renews it each look; expires if it died)."""
    return batch_key(batch_id, "waker")


def infra_streak_key(batch_id: str) -> str:
    """The batch's latest infrastructure failures in a row (the circuit breaker's count)."""
    return batch_key(batch_id, "infra-streak")


def collect_copies_key(batch_id: str) -> str:
    """How many times a copy of a collect task found another copy collecting its episode."""
    return batch_key(batch_id, "collect-copies")


def groups_key(batch_id: str) -> str:
    """Hash group id -> the group's figures (JSON), written once when its last sample has its
    row (the `group` stream entry is written with it)."""
    return batch_key(batch_id, "groups")


def counted_key(batch_id: str) -> str:
    """List of the group ids that made the batch's quota (`groups_wanted`), in order."""
    return batch_key(batch_id, "counted")


def policy_version_key(trainer: str) -> str:
    """A trainer's current policy version, as it published it (`max_policy_lag` reads it)."""
    return f"{KEY_PREFIX}:trainer:{trainer}:policy-version"


def flag_key(batch_id: str, name: str) -> str:
    return batch_key(batch_id, f"flag:{name}")


# Deterministic Celery ids: a redelivered submit re-sends the same ids, and the result
# backend plus our own per-index dedupe make the copies harmless.
def collect_task_id(batch_id: str, index: int) -> str:
    return f"{batch_id}.collect.{index}"


def aggregate_task_id(batch_id: str) -> str:
    return f"{batch_id}.aggregate"


def chord_group_task_id(batch_id: str) -> str:
    """The Celery group of a batch's collectors (not a task group: see request.group_id)."""
    return f"{batch_id}.group"


def watchdog_task_id(batch_id: str) -> str:
    return f"{batch_id}.watchdog"


def feed_task_id(batch_id: str) -> str:
    return f"{batch_id}.feed"


def wake_task_id(batch_id: str) -> str:
    return f"{batch_id}.wake"


def cancel_task_id(batch_id: str) -> str:
    return f"{batch_id}.cancel"


def cleanup_task_id(batch_id: str) -> str:
    return f"{batch_id}.cleanup"


# Stream entries: a flat hash with a `type` field and the fields of that type.
ENTRY_EPISODE = "episode"  # fields: index, row (JSON)
ENTRY_REPORT = "report"  # fields: status
ENTRY_STATE = "state"  # fields: index, state (progress of one episode before its row)
ENTRY_GROUP = "group"  # fields: group_id, counted (0/1), group (JSON): a group's last row is in

# Progress states in the order an episode passes them; a state never goes back.
STATES = tuple(Progress)


def states_key(batch_id: str) -> str:
    """Hash index -> the furthest progress state seen (dedupes state entries)."""
    return batch_key(batch_id, "states")


# Labels / names shared by backends.
LABEL_OWNER = "rollout.dev/owner"
LABEL_OWNER_VALUE = "rollout"
LABEL_BATCH = "rollout.dev/batch"
# Warm pools (rollout_worker/backends/warm.py): a pool's namespace and Pods carry LABEL_POOL
# (the shape key); a pool Pod is idle until a batch claims it (LABEL_BATCH and the episode
# index added).
LABEL_POOL = "rollout.dev/pool"
LABEL_POOL_STATE = "rollout.dev/pool-state"
LABEL_EPISODE_INDEX = "rollout.dev/episode-index"
ANNOTATION_CLAIMED_AT = "rollout.dev/claimed-at"

# Hash pool key -> JSON proof of what the pool created (namespace name, then its UID) and when
# a batch last asked for it; written before the pool's first mutation.
POOLS_KEY = f"{KEY_PREFIX}:pools"

# Sandbox hosts (isolation "host", rollout_worker/backends/host/queue.py). Global keys:
HOSTS_PREFIX = f"{KEY_PREFIX}:hosts"
# List of `batch:index` released to hosts and not taken yet: hosts BLMOVE from it.
HOSTS_TODO_KEY = f"{HOSTS_PREFIX}:todo"
# List of `batch:index` released and not ended yet (waiting or running), one entry each, kept
# by the queue's scripts: the hosts' demand, KEDA's listName (LLEN / slots = hosts wanted).
HOSTS_DEMAND_KEY = f"{HOSTS_PREFIX}:demand"
# Hash host -> its last heartbeat (JSON: slots, free, batches, program_sha, images, seen_at).
HOSTS_ALIVE_KEY = f"{HOSTS_PREFIX}:alive"
# Hash batch id -> JSON {run_uid, created_at} of every host run not deleted yet (list_runs).
HOSTS_RUNS_KEY = f"{HOSTS_PREFIX}:runs"


def hosts_taking_key(host: str) -> str:
    """List holding what a host moved off the todo list and has not taken yet (a reliable
    queue: a host that dies in between leaves it here, and a reap puts it back)."""
    return f"{HOSTS_PREFIX}:taking:{host}"


def hosts_seen_key(host: str) -> str:
    """Set with a TTL by each heartbeat: its absence says the host is gone."""
    return f"{HOSTS_PREFIX}:seen:{host}"


def host_batch_key(batch_id: str, part: str) -> str:
    """A host run's own keys: run (hash), status, taken, attempts, records (hashes),
    log:<i>, lease:<i> (strings). `delete` removes all of them."""
    return batch_key(batch_id, f"host:{part}")

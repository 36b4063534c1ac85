"""The batch lifecycle without Celery, one module per concern:

- `state`: the store protocol, the receipt, the limits, a batch's flags.
- `admit`: validate a request, write the receipt, start (or adopt) the run.
- `collect`: one episode's row, the watchdog's rescue, when an episode is given up on.
- `groups`: each group streamed once as it completes; the quota (`groups_wanted`).
- `finalize`: the report once; `save_records`: then the run's records.
- `runs`: cleanup, cancel, the sweeper, which backend reaches a run.
- `pools`: warm pool refill and drain.
- `feed`: a run fed from its pool, one waiting sandbox per freed slot.
- `park`: collectors parked until their episode ends, and the waker that sends them again.
- `worker`: what each Celery task decides (what to send next), for `tasks.py`.
- `retry`: when a task runs again: the retry budgets, what a transient backend error makes of
  each task.
- `waker`: the threads of a process's wakers and the pool that records a burst of ends.

Unit tests call these with an in-memory store and a stub backend. Every function is safe to
run again for the same batch (brokers redeliver): the store's writes are first-writer-wins.
This module re-exports the names callers use, so `from rollout_worker import core` is enough.
"""

from rollout_worker.core.admit import Submitted, admit, fail, submit
from rollout_worker.core.collect import (
    RESCUE_ENDED_SECONDS,
    STORED_LOG_BYTES,
    claim,
    collect,
    give_up_at,
    rescue,
    watchdog_countdown,
)
from rollout_worker.core.feed import FEEDER_INDEX, feed
from rollout_worker.core.finalize import Finalized, finalize, save_records
from rollout_worker.core.pools import drain_pools, fill_pool
from rollout_worker.core.retry import MAX_RETRIES, Again
from rollout_worker.core.runs import (
    CLEANUP_RECHECK_SECONDS,
    SWEEP_STALLED_CLEANUP_SECONDS,
    Swept,
    backend_for_run,
    cancel,
    cleanup,
    cleanup_pending,
    sweep,
    sweep_backends,
)
from rollout_worker.core.state import (
    FLAG_CANCEL,
    FLAG_CHORD,
    FLAG_HALT,
    FLAG_QUOTA,
    FLAG_STOPPED,
    BatchStore,
    Limits,
    NotYet,
    Receipt,
    load_receipt,
)
from rollout_worker.core.worker import (
    REDIS_WAIT_SECONDS,
    Park,
    Scheduler,
    Worker,
)

__all__ = [
    "CLEANUP_RECHECK_SECONDS",
    "FEEDER_INDEX",
    "FLAG_CANCEL",
    "FLAG_CHORD",
    "FLAG_HALT",
    "FLAG_QUOTA",
    "FLAG_STOPPED",
    "MAX_RETRIES",
    "REDIS_WAIT_SECONDS",
    "RESCUE_ENDED_SECONDS",
    "STORED_LOG_BYTES",
    "SWEEP_STALLED_CLEANUP_SECONDS",
    "Again",
    "BatchStore",
    "Finalized",
    "Limits",
    "NotYet",
    "Park",
    "Receipt",
    "Scheduler",
    "Submitted",
    "Swept",
    "Worker",
    "admit",
    "backend_for_run",
    "cancel",
    "claim",
    "cleanup",
    "cleanup_pending",
    "collect",
    "drain_pools",
    "fail",
    "feed",
    "fill_pool",
    "finalize",
    "give_up_at",
    "load_receipt",
    "rescue",
    "save_records",
    "submit",
    "sweep",
    "sweep_backends",
    "watchdog_countdown",
]

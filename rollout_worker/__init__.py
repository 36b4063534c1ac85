"""Rollout worker: runs batches of sandboxed RL episodes through Celery and Redis.

Layers, each importing only those below it (`tests/unit/test_layers.py` checks what each kind
of process loads):
- `rollout_wire` (its own package, below everything): the contract shared with trainers.
- pure core modules (no I/O of their own): settings, quantities, observation, schedule,
  validation, metrics, report, sandbox (the episode program as data).
- `backends/`: `base` (the Backend and PoolBackend protocols, RunHandle) and `warm`
  (backend-neutral warm pools), both pure; `kube/` (objects and read pure, then watch, pools,
  namespaces, permissions and backend: the API calls) and `local/` (files, sandbox, signal,
  policy_proxy, pool, supervisor, backend: processes on this machine). `store` (Redis) sits
  beside them.
- `core`: the batch lifecycle against the store and backend protocols, without Celery.
- `tasks`: the Celery wiring (one core call per task); `celery_app`: the app factory.
- `cli/` on top: the `rollout` command, the local stack, reports and plots, the scripted
  policy server. The only modules that use rich, matplotlib or the trainer's client
  (`trainer_stub`); worker processes load only `cli/main.py` and `cli/common.py` of it.
"""

__version__ = "0.1.0"

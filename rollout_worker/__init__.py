"""Rollout worker: runs batches of sandboxed RL episodes through Celery and Redis.

Layers, each importing only those below it:
- `rollout_wire` (its own package): the contract shared with trainers.
- pure core: settings, quantities, observation, validation, metrics, report, manifests,
  backends.kube_read, and `core` (the batch lifecycle against a store and backend protocol).
- I/O: store (Redis), backends (local, kubernetes), tasks (Celery wiring), celery_app.
- on top: cli, stack, plots, report_cmd (the only modules that use rich, matplotlib or the
  trainer's client; worker processes never import them).
"""

__version__ = "0.1.0"

"""The trainer's side: submit sampling rounds and receive their reports through Redis.

Imports only the shared wire modules of rollout_worker (constants, models, errors), never the
worker's tasks, backends or Kubernetes.
"""

from trainer_stub.client import RolloutClient, Submission

__all__ = ["RolloutClient", "Submission"]

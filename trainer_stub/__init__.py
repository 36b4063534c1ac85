"""The trainer's side: submit sampling rounds and receive their reports through Redis.

    from trainer_stub import submit_batch
    report = submit_batch.delay(count=100, parallelism=20).wait()

Imports only `rollout_wire` (the shared contract), never the workers' tasks, backends or
Kubernetes.
"""

from trainer_stub.client import RolloutClient, Submission, SubmitBatch, submit_batch

__all__ = ["RolloutClient", "Submission", "SubmitBatch", "submit_batch"]

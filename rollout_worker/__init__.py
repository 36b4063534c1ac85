"""Rollout worker: runs batches of sandboxed RL episodes through Celery and Redis.

This package's top level imports nothing heavy, so the trainer side can import the shared
pure modules (``constants``, ``models``, ``errors``, ``records``) without Celery workers or
Kubernetes.
"""

__version__ = "0.1.0"

"""Backends run a batch's sandboxes. `get_backend` is the only way to obtain one."""

from __future__ import annotations

from rollout_wire.errors import BackendUnavailable
from rollout_worker.backends.base import Backend, FinishedRun, ReceiptUpdate, RunHandle
from rollout_worker.settings import Settings

__all__ = ["Backend", "FinishedRun", "ReceiptUpdate", "RunHandle", "get_backend"]


def get_backend(name: str, settings: Settings) -> Backend:
    if name == "local":
        from rollout_worker.backends.local.backend import LocalBackend

        return LocalBackend(settings)
    if name == "kubernetes":
        from rollout_worker.backends.kube.backend import KubernetesBackend

        return KubernetesBackend(settings)
    raise BackendUnavailable(f"unknown backend {name!r}; known: local, kubernetes")

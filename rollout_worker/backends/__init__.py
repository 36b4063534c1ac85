"""Backends run a batch's sandboxes. `get_backend` is the only way to obtain one."""

from __future__ import annotations

from rollout_worker.backends.base import Backend, ReceiptUpdate, RunHandle
from rollout_worker.errors import BackendUnavailable
from rollout_worker.settings import Settings

__all__ = ["Backend", "ReceiptUpdate", "RunHandle", "get_backend"]


def get_backend(name: str, settings: Settings) -> Backend:
    if name == "local":
        from rollout_worker.backends.local import LocalBackend

        return LocalBackend(settings)
    if name == "kubernetes":
        raise BackendUnavailable(
            "the kubernetes backend is not part of this build yet; use --backend local"
        )
    raise BackendUnavailable(f"unknown backend {name!r}; known: local, kubernetes")

"""Backends run a batch's sandboxes. `get_backend` is the only way to obtain one, and
`backend_name` says which one a batch runs on."""

from __future__ import annotations

from rollout_wire.errors import BackendUnavailable
from rollout_wire.request import BatchSpec
from rollout_worker.backends.base import Backend, FinishedRun, ReceiptUpdate, RunHandle
from rollout_worker.settings import Settings

__all__ = ["Backend", "FinishedRun", "ReceiptUpdate", "RunHandle", "backend_name", "get_backend"]

# Kubernetes with `isolation: host`: the sandbox hosts' backend (Redis only, no API calls).
HOSTS = "hosts"


def backend_name(spec: BatchSpec) -> str:
    """The backend that runs `spec`'s sandboxes (its receipt's `run.backend`)."""
    if spec.backend == "kubernetes" and spec.isolation == "host":
        return HOSTS
    return spec.backend


def get_backend(name: str, settings: Settings) -> Backend:
    if name == "local":
        from rollout_worker.backends.local.backend import LocalBackend

        return LocalBackend(settings)
    if name == "kubernetes":
        from rollout_worker.backends.kube.backend import KubernetesBackend

        return KubernetesBackend(settings)
    if name == HOSTS:
        from rollout_worker.backends.host.backend import HostBackend

        return HostBackend(settings)
    raise BackendUnavailable(f"unknown backend {name!r}; known: local, kubernetes, {HOSTS}")

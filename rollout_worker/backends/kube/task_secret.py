"""The API side of a batch's task env templates (task_env.py builds the objects): read the
user's Secret (`task_env_secret`) in the workers' namespace, refuse the batch before anything
is created when a ${VAR} without a default has no key there, and make the batch namespace's
copy of the keys its tasks use. A batch without templates makes none of these calls.

Values are read and written as the API's base64 `data`, never decoded, logged or recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from rollout_wire.errors import BackendError, ResourceConflict, ResourceNotFound
from rollout_wire.request import BatchSpec
from rollout_wire.task_spec import env_templates
from rollout_worker.backends.kube import api, task_env
from rollout_worker.backends.kube.objects import owner_labels
from rollout_worker.settings import Settings


def _templated(spec: BatchSpec) -> bool:
    return any(env_templates(task) for task in spec.tasks)


def read_source(
    call: Callable[..., Any], core: Any, name: str, namespace: str
) -> dict[str, str] | None:
    """The user's Secret's `data` (base64, as the API returns it), None when it does not
    exist."""
    try:
        secret = call(
            f"read Secret {namespace}/{name}", core.read_namespaced_secret, name, namespace
        )
    except ResourceNotFound:
        return None
    return dict(secret.get("data") or {})


def source_for(
    call: Callable[..., Any], core: Any, spec: BatchSpec, settings: Settings
) -> dict[str, str] | None:
    """The user's Secret's data (in the workers' namespace) the batch's templates take their
    values from ({} when they need none), or BackendError naming each task and key it cannot
    resolve; None when the batch has no template (no call made)."""
    if not _templated(spec):
        return None
    namespace = api.workers_namespace(settings)
    source: dict[str, str] | None = {}
    if spec.task_env_secret is not None:
        source = read_source(call, core, spec.task_env_secret, namespace)
    keys = None if source is None else set(source)
    problems = task_env.preflight_problems(spec.tasks, spec.task_env_secret, keys)
    if problems:
        raise BackendError(f"{'; '.join(problems)} (workers' namespace {namespace!r})")
    return source or {}


def create_copy(
    call: Callable[..., Any],
    core: Any,
    spec: BatchSpec,
    source: Mapping[str, str] | None,
    namespace: str,
) -> None:
    """The batch namespace's copy (task_env.batch_secret), labelled as the batch's objects and
    deleted with its namespace. It is made only in the batch's own namespace, once its UID is
    recorded: one already there was made by an earlier delivery of this submit (the workers
    may create Secrets but never read one there, so it is not read back)."""
    manifest = task_env.batch_secret(spec.tasks, source or {}, namespace, owner_labels(spec))
    if manifest is None:
        return
    with contextlib.suppress(ResourceConflict):
        call("create secret", core.create_namespaced_secret, namespace, manifest)

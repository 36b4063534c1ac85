"""The one way a namespace of ours is deleted (a batch's by `delete_batch_namespace`, for
`backend.delete_run`; a pool's by `pools.WarmPools.drain`): read it, prove it is ours, delete
it with its UID as precondition.

Below both callers (`backend.py` imports `pools.py`), so neither imports the other for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from kubernetes import client

from rollout_wire.errors import OwnershipError, ResourceNotFound
from rollout_worker.backends.base import KubeRunHandle
from rollout_worker.backends.kube.objects import JOB_NAME
from rollout_worker.backends.kube.read import labelled_ours

Call = Callable[..., Any]
Namespace = dict[str, Any]


def delete_namespace(
    call: Call,
    core: client.CoreV1Api,
    namespace: str,
    what: str,
    prove: Callable[[Namespace], None],
    ready: Callable[[Namespace], bool],
) -> bool:
    """Delete `namespace` once it is proven ours. Never waits: True once it is gone, False
    while Kubernetes is still deleting it (or `ready` held the deletion back).

    `prove` raises OwnershipError unless the namespace read is the one we created (labels,
    UID); `ready`, called only for a namespace not already being deleted, does what must come
    first and says whether the namespace may go now. The delete carries the UID read as its
    precondition, so the server refuses if the namespace was replaced since it was checked.
    Finalizers are never removed by force."""
    try:
        ns = call(f"read {what}", core.read_namespace, namespace)
    except ResourceNotFound:
        return True
    prove(ns)
    if ns["metadata"].get("deletionTimestamp") or not ready(ns):
        return False
    body = {"propagationPolicy": "Background", "preconditions": {"uid": ns["metadata"]["uid"]}}
    try:
        call(f"delete {what}", core.delete_namespace, namespace, body=body)
    except ResourceNotFound:
        return True
    return False


def delete_batch_namespace(
    call: Call,
    core: client.CoreV1Api,
    batch: client.BatchV1Api,
    handle: KubeRunHandle,
    namespace: str,
) -> bool:
    """Delete a run's namespace once its UID and labels, and its Jobs' UIDs, match the
    receipt (`handle`). Does not wait: True once the namespace is gone."""

    def prove(ns: Namespace) -> None:
        labels = ns["metadata"].get("labels") or {}
        uid = ns["metadata"]["uid"]
        if uid != handle.namespace_uid or not labelled_ours(ns, handle.batch_id):
            raise OwnershipError(
                f"namespace {namespace} has uid {uid} and labels {labels}; "
                f"the receipt says uid {handle.namespace_uid} and batch "
                f"{handle.batch_id}: refusing to delete what we cannot prove we created"
            )

    def jobs_ours(_ns: Namespace) -> bool:
        for name, uid in (handle.job_uids() or {JOB_NAME: None}).items():
            with contextlib.suppress(ResourceNotFound):
                job = call("read job", batch.read_namespaced_job, name, namespace)
                job_labels = job["metadata"].get("labels") or {}
                # A run cut short before the Job's UID was recorded (a CLI killed mid-run,
                # whose receipt.json names the namespace UID only): the Job's labels are
                # the proof.
                if (uid is not None and job["metadata"]["uid"] != uid) or (
                    uid is None and not labelled_ours(job, handle.batch_id)
                ):
                    raise OwnershipError(
                        f"Job {namespace}/{name} has uid {job['metadata']['uid']} and "
                        f"labels {job_labels}, the receipt says uid {uid}: refusing to "
                        "delete its namespace"
                    )
        return True

    return delete_namespace(call, core, namespace, "namespace", prove, jobs_ours)

"""The one way a namespace of ours is deleted (a batch's by `backend.delete_run`, a pool's by
`pools.WarmPools.drain`): read it, prove it is ours, delete it with its UID as precondition.

Below both callers (`backend.py` imports `pools.py`), so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client

from rollout_wire.errors import ResourceNotFound

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

"""`rollout check` on a cluster: what the Kubernetes backend finds there (apart from the
backend, which only runs batches)."""

from __future__ import annotations

from kubernetes import client

from rollout_wire.errors import ResourceNotFound
from rollout_worker.backends.kube.backend import KubernetesBackend
from rollout_worker.backends.kube.read import node_ready


def check(backend: KubernetesBackend, runtime: str) -> tuple[list[str], list[str]]:
    """(what was found, what is missing) in the cluster: version, Ready nodes, RuntimeClass."""
    found, missing = [], []
    call = backend._call
    version = call("version", client.VersionApi(backend.api).get_code)
    found.append(f"cluster: {backend.context} ({version.get('gitVersion')})")
    nodes = call("nodes", backend.core.list_node)["items"]
    ready = [n["metadata"]["name"] for n in nodes if node_ready(n)]
    found.append(f"nodes: {len(ready)} ready of {len(nodes)}")
    if not ready:
        missing.append("no Ready node")
    try:
        rc = call(f"RuntimeClass {runtime}", backend.nodes_api.read_runtime_class, runtime)
        overhead = (rc.get("overhead") or {}).get("podFixed") or {}
        found.append(
            f"RuntimeClass {runtime}: handler {rc.get('handler')}, overhead {overhead or 'none'}"
        )
    except ResourceNotFound:
        missing.append(f"RuntimeClass {runtime!r} does not exist (use --runtime)")
    return found, missing

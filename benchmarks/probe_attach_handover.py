"""Feasibility probe for warm sandboxes (issue 15): how fast an episode reaches a Pod that is
already running, through the API server, without opening the Pod's network.

It starts N Pods on the real node, each running a waiter that reads one JSON line on stdin
(`stdin: true, stdinOnce: true`), then for each Pod: attaches (websocket through the API server
and the kubelet), writes the episode line, and reads stdout until the Pod's `ready` line. The
figure is that whole round trip (claim -> ready), with the attach connect time beside it.

Not the warm pool itself: no claim, no labels, no validation. The namespace it makes
(`warm-attach-probe`) is deleted at the end.

    python -m benchmarks.probe_attach_handover [--pods 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kubernetes import client
from kubernetes.stream import stream

from tests.k8s import cluster as kc

NAMESPACE = "warm-attach-probe"
WAITER = (
    "import json, sys, time\n"
    "episode = json.loads(sys.stdin.readline())\n"
    "print(json.dumps({'event': 'ready', 'at': time.time(), 'episode_id': episode['id']}),"
    " flush=True)\n"
    "time.sleep(2)\n"
)


def waiter_pod(name: str, node: kc.RealNode) -> dict:
    return {
        "metadata": {"name": name, "labels": {"rollout.dev/probe": "attach"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "nodeSelector": node.node_selector,
            "tolerations": node.tolerations,
            "runtimeClassName": node.runtime_class,
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
            "containers": [
                {
                    "name": "episode",
                    "image": node.image,
                    "imagePullPolicy": node.image_pull_policy,
                    "command": ["python", "-c", WAITER],
                    "stdin": True,
                    "stdinOnce": True,
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def hand_over(core: client.CoreV1Api, name: str) -> tuple[float, float]:
    """(claim -> ready seconds, attach connect seconds) for one waiting Pod."""
    start = time.perf_counter()
    ws = stream(
        core.connect_get_namespaced_pod_attach,
        name,
        NAMESPACE,
        container="episode",
        stdin=True,
        stdout=True,
        stderr=False,
        tty=False,
        _preload_content=False,
    )
    connected = time.perf_counter()
    ws.write_stdin(json.dumps({"id": name}) + "\n")
    out = ""
    while '"ready"' not in out:
        if time.perf_counter() - start > 10:
            raise RuntimeError(f"no ready line from {name} in 10 s: {out!r}")
        ws.update(timeout=1)
        if ws.peek_stdout():
            out += ws.read_stdout()
    done = time.perf_counter()
    ws.close()
    return done - start, connected - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=10)
    args = parser.parse_args()
    cluster = kc.ensure_cluster()
    node = kc.ensure_real_node(cluster)
    core = cluster.core
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    try:
        names = [f"waiter-{i}" for i in range(args.pods)]
        for name in names:
            core.create_namespaced_pod(NAMESPACE, waiter_pod(name, node))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pods = core.list_namespaced_pod(NAMESPACE).items
            if sum(p.status.phase == "Running" for p in pods) == len(names):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("the waiter Pods did not all start in 120 s")
        times = [hand_over(core, name) for name in names]
    finally:
        core.delete_namespace(NAMESPACE)
    ready = sorted(t for t, _ in times)
    print(f"claim -> ready ms: {[round(t * 1000) for t, _ in times]}")
    print(
        f"p50 {statistics.median(ready) * 1000:.0f} ms, max {ready[-1] * 1000:.0f} ms; "
        f"attach connect p50 {statistics.median(c for _, c in times) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()

"""bench_slots' sandbox hosts (issue 46): the host pool it starts on the real node before the
rounds, and the pure ratios and goals its summary prints for pods, hosts and local side by side.

The pool is the one rollout_worker/backends/host/manifests.py builds and tests/k8s/test_hosts.py
runs: a Deployment of host Pods in the host image, reaching the benchmark's Redis at the node's
address (LocalStack.redis_bind). It is started and made ready (every host's heartbeat says all
its slots free) before the rounds, untimed; it stays up through them, so its idle CPU lands in
every side's machine CPU as the pools' refills do (the idle floor is measured before it starts).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
from kubernetes import client as kube_client

from rollout_worker.backends.host import manifests
from rollout_worker.backends.host.queue import HostQueue

# Per round: name -> (numerator side, denominator side, figure).
RATIOS = {
    "hosts / local": ("hosts", "local", "wall"),
    "hosts / local machine CPU": ("hosts", "local", "cpu"),
    "pods / hosts": ("pods", "hosts", "wall"),
    "pods / hosts machine CPU": ("pods", "hosts", "cpu"),
    "pods / local": ("pods", "local", "wall"),
    "pods / before": ("pods", "before", "wall"),
    "pods / before machine CPU": ("pods", "before", "cpu"),
}


class Goal(NamedTuple):
    name: str  # the figure whose median is judged
    goal: float
    how: str  # "<=" or ">="
    title: str = ""  # what the goal says in words, when its figure alone does not


# docs/sandbox-hosts-plan.md and issue 26's, for the default batch.
GOALS = [
    Goal("hosts / local", 1.3, "<="),
    Goal("hosts / local machine CPU", 1.2, "<="),
    Goal("pods / before", 1 / 3, "<="),
    Goal("pods / local", 2.0, "<="),
    Goal("pods slot utilisation", 0.6, ">="),
]
# Issue 46's, for a burst (benchmarks/burst_tasks.py).
BURST_GOALS = [Goal("pods / hosts", 3.0, ">=", "burst: hosts >= 3x faster than pods")]
# Issue 46's first, for its batch (benchmarks/distinct_tasks.py): the plan's two, by name.
DISTINCT_GOALS = [
    Goal("hosts / local", 1.3, "<=", "issue 46 batch: hosts' wall at most 1.3x local's"),
    Goal("hosts / local machine CPU", 1.2, "<=", "issue 46 batch: hosts' CPU at most 1.2x local's"),
]


def ratios(walls: dict[str, float], cpu: dict[str, float]) -> dict[str, float]:
    """One round's ratios among the sides it ran (a ratio whose sides did not both run, or
    whose denominator is not positive, is left out)."""
    figures = {"wall": walls, "cpu": cpu}
    out: dict[str, float] = {}
    for name, (top, bottom, figure) in RATIOS.items():
        values = figures[figure]
        if top in values and bottom in values and values[bottom] > 0:
            out[name] = values[top] / values[bottom]
    return out


def goal_lines(medians: dict[str, float], goals: list[Goal] = GOALS) -> list[str]:
    """`goal NAME <= X: met|MISSED (median)` for each goal whose figure was measured (`goal
    TITLE (NAME <= X): ...` for a goal with a title)."""
    lines = []
    for name, goal, how, title in goals:
        if name not in medians:
            continue
        median = medians[name]
        met = median <= goal if how == "<=" else median >= goal
        said = f"{name} {how} {goal:.2f}"
        said = f"{title} ({said})" if title else said
        lines.append(f"goal {said}: {'met' if met else 'MISSED'} ({median:.2f})")
    return lines


def side_by_side(figures: dict[str, list[float]], sides: list[str]) -> list[str]:
    """The per-side figures as one table: a row per figure (`<side> <figure>` names), a
    column per side, each cell the median over rounds."""
    rows: dict[str, dict[str, float]] = {}
    for name, values in figures.items():
        side, _, figure = name.partition(" ")
        # "hosts / local" is a ratio between sides, not a figure of "hosts".
        if side in sides and figure and not figure.startswith("/") and values:
            rows.setdefault(figure, {})[side] = sorted(values)[(len(values) - 1) // 2]
    lines = [f"{'median':34}" + "".join(f"{side:>12}" for side in sides)]
    for figure, cells in rows.items():
        digits = 0 if figure.endswith("episodes") else 2
        line = "".join(
            f"{cells[side]:>12.{digits}f}" if side in cells else f"{'-':>12}" for side in sides
        )
        lines.append(f"{figure:34}{line}")
    return lines


def free_slots(beats: dict[str, dict[str, Any]]) -> int:
    """Free slots over the live hosts that take work (a draining host takes nothing)."""
    return sum(int(b.get("free", 0)) for b in beats.values() if not b.get("draining"))


@dataclass
class HostPoolRun:
    """A host pool on the real node for the length of a benchmark."""

    cluster: Any
    pool: manifests.HostPool

    @classmethod
    def plan(
        cls, cluster: Any, node: Any, image: str, redis_url: str, parallelism: int, **kw: Any
    ) -> HostPoolRun:
        """`replicas` hosts holding `parallelism` slots between them (kw: HostPool fields)."""
        replicas = int(kw.pop("replicas", 1))
        fields = {
            "namespace": f"bench-hosts-{uuid.uuid4().hex[:6]}",
            "image": image,
            "redis_url": redis_url,
            "slots": math.ceil(parallelism / replicas),
            "replicas": replicas,
            "image_pull_policy": node.image_pull_policy,
            "runtime_class": node.runtime_class,
            "node_selector": node.node_selector,
            "tolerations": tuple(node.tolerations),
            "termination_grace_seconds": 5,
        }
        return cls(cluster, manifests.HostPool(**(fields | kw)))

    def start(self, client: redis.Redis, timeout: float = 300) -> float:
        """Create the pool and wait until every host's slots are free; the seconds it took."""
        started = time.monotonic()
        ns = self.pool.namespace
        self.cluster.core.create_namespace({"metadata": {"name": ns}})
        policy, deployment = manifests.host_objects(self.pool)
        kube_client.NetworkingV1Api(self.cluster.api_client).create_namespaced_network_policy(
            ns, policy
        )
        kube_client.AppsV1Api(self.cluster.api_client).create_namespaced_deployment(ns, deployment)
        self.ready(client, timeout)
        return time.monotonic() - started

    def ready(self, client: redis.Redis, timeout: float = 300) -> None:
        """Wait until the hosts' heartbeats show all the pool's slots free (the last batch's
        sandboxes gone): the hosts side's counterpart of a refilled warm pool."""
        want = self.pool.slots * self.pool.replicas
        queue = HostQueue(client)
        deadline = time.monotonic() + timeout
        while free_slots(queue.hosts()) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"hosts: {want} free slots not reported in {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Delete the namespace (the Deployment and its Pods go with it)."""
        self.cluster.core.delete_namespace(self.pool.namespace)

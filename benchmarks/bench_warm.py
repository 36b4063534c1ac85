"""Warm vs cold (issue 15), side by side in one run: the real node, or the local backend.

Each round runs, with the same workers (a control worker and two collectors, started once):
- cold: a batch of `--count` episodes while the pool of its shape has no waiting Pod;
- fill: a one-episode batch with warm_pool=`--count` (the refill behind it is what a trainer's
  previous round leaves), then the benchmark waits until that many pool Pods wait;
- warm: a batch of `--count` episodes, which takes them all from the pool;
- drained (Kubernetes): after it, a batch of `--count` episodes that finds the pool's
  namespace with nothing waiting in it (the warm batch took it all): it must run cold, no
  slower than the cold batch. The cold and drained batches each start once the machine has
  settled (`proc.settle`: under half a core busy), so neither pays for the node's teardown of
  the batch before it.
Figures per batch: submit -> report (the client's `submit` call to its `wait` returning), and
per episode: cold, Pod created -> `ready` event (the guide's metric); warm, claim -> `ready`
event (the row's `handover_seconds`: the claim patch's time to the runner's own event); per
batch also submit -> the last episode's `ready` event (the runner's clock: same machine). Each
batch's cleanup ends before the next batch starts. Printed: median [min-max] over rounds of
each round's p50 / p95 / wall, and the warm/cold wall ratio of each round.

`--backend local`: the same on this machine's bwrap sandboxes (a private ROLLOUT_LOCAL_ROOT),
where "Pod created" is the sandbox process started. Kubernetes (the default) needs the local
cluster with the real node: `hack/localkube/cluster.sh node-up`.

A burst (issue 26): `--count 100 --cpu-request 10m --memory-request 16Mi` (100 sandboxes
waiting on a 2-core node need a small request; the pool budget is raised to fit), with
`--handover-threads N` for the claims and hand-overs one worker runs at once.

On the real node the workers hand warm Pods their episodes directly (a TCP connection to the
Pod, ROLLOUT_WARM_HANDOVER_FROM = the node's IP; kube/handover.py); `--attach` hands them
over through the API server's attach only, as before.

    python -m benchmarks.bench_warm [--backend kubernetes|local] [--rounds 3] [--count 10]
        [--handover-threads N] [--cpu-request Q --memory-request Q] [--attach]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Figures, Stats, p95, percentile, require_rounds
from benchmarks.proc import settle
from rollout_wire import constants as k
from rollout_wire.request import parse_spec
from rollout_worker.backends import warm as warm_pools
from rollout_worker.backends.kube import objects
from rollout_worker.cli.stack import LocalStack
from rollout_worker.sandbox import episode_program_text
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient


def waiting_pods(cluster: kc.Cluster, namespace: str) -> int:
    pods = cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{k.LABEL_POOL_STATE}={objects.POOL_STATE_IDLE}"
    ).items
    return sum(
        1
        for p in pods
        if p.status.phase == "Running"
        and any(c.state.running for c in p.status.container_statuses or [])
    )


def run_batch(
    client: RolloutClient, fields: dict[str, Any], **extra: Any
) -> tuple[dict, float, float]:
    """(report, submit -> report seconds, submit -> last `ready` event seconds)."""
    start, clock = time.perf_counter(), time.time()
    submission = client.submit(**fields, **extra)
    report = client.wait(submission.batch_id, timeout=600)
    wall = time.perf_counter() - start
    all_ready = max(row["ready_at"] for row in report["pods"]) - clock
    deadline = time.monotonic() + 300
    while client.receipt(submission.batch_id).get("cleanup") != "deleted":
        if time.monotonic() > deadline:
            raise RuntimeError(f"cleanup of {submission.batch_id} did not end")
        time.sleep(0.5)
    if report["successful_episodes"] != report["episodes"]:
        raise RuntimeError(f"batch {submission.batch_id} failed: {report['status']}")
    return report, wall, all_ready


class KubeTarget:
    """The real node: batches of its shape; the pool's waiting Pods read from the API."""

    def __init__(self) -> None:
        self.cluster = kc.ensure_cluster()
        self.node = kc.ensure_real_node(self.cluster)
        self.fields = self.node.batch_fields() | {"backend": "kubernetes"}
        spec = parse_spec(self.fields | {"count": 1}, max_episodes=None)
        key = warm_pools.pool_key(spec, episode_program_text())
        assert key is not None
        self.namespace = objects.pool_namespace(key)
        self.env = {"KUBECONFIG": str(self.cluster.kubeconfig)}
        self.handover_from = kc.handover_from(self.cluster)
        self.where = f"the real node {self.node.name}"

    def waiting(self) -> int:
        names = {ns.metadata.name for ns in self.cluster.core.list_namespace().items}
        return waiting_pods(self.cluster, self.namespace) if self.namespace in names else 0


class LocalTarget:
    """This machine's bwrap sandboxes: the pool's waiting count from its state file."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rollout-bench-warm-"))
        self.root.chmod(0o755)
        self.fields = {"backend": "local"}
        self.env = {"ROLLOUT_LOCAL_ROOT": str(self.root), "ROLLOUT_LOCAL_ISOLATION": "bwrap"}
        self.where = "the local backend (bwrap)"

    def waiting(self) -> int:
        total = 0
        for state in self.root.glob("_pools/*/state.json"):
            with contextlib.suppress(OSError, ValueError):
                total += json.loads(state.read_text())["waiting"]
        return total


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--backend", choices=["kubernetes", "local"], default="kubernetes")
    parser.add_argument("--handover-threads", type=int, default=None)
    parser.add_argument("--cpu-request", default=None)
    parser.add_argument("--memory-request", default=None)
    parser.add_argument(
        "--warm-only", action="store_true", help="no cold or drained batches: the burst alone"
    )
    parser.add_argument(
        "--attach", action="store_true", help="hand over by attach only (no direct hand-over)"
    )
    args = parser.parse_args()
    require_rounds(parser, args.rounds)
    return args


def batch_shape(
    args: argparse.Namespace, target: KubeTarget | LocalTarget
) -> tuple[dict[str, Any], dict[str, str]]:
    """The batches' fields and the workers' env; the pool namespace of that shape."""
    fields = dict(target.fields)
    if args.cpu_request or args.memory_request:
        fields["resources"] = {
            **({"cpu_request": args.cpu_request} if args.cpu_request else {}),
            **({"memory_request": args.memory_request} if args.memory_request else {}),
        }
    env = dict(target.env) | {"ROLLOUT_WARM_POOL_BUDGET": str(max(64, 2 * args.count))}
    if args.handover_threads:
        env["ROLLOUT_WARM_HANDOVER_THREADS"] = str(args.handover_threads)
    if isinstance(target, KubeTarget) and target.handover_from and not args.attach:
        env["ROLLOUT_WARM_HANDOVER_FROM"] = target.handover_from
    if isinstance(target, KubeTarget) and "resources" in fields:
        spec = parse_spec(fields | {"count": 1}, max_episodes=None)
        key = warm_pools.pool_key(spec, episode_program_text())
        assert key is not None
        target.namespace = objects.pool_namespace(key)
    return fields, env


class Rounds:
    """Cold, fill, warm and drained batches on one stack, and the figures they gave."""

    def __init__(
        self,
        args: argparse.Namespace,
        target: KubeTarget | LocalTarget,
        client: RolloutClient,
        fields: dict[str, Any],
    ) -> None:
        self.args, self.target, self.client, self.fields = args, target, client, fields
        self.figures = Figures()

    def batch(self, **extra: Any) -> tuple[dict, float, float]:
        return run_batch(self.client, self.fields, **extra)

    def fill(self) -> None:
        """A one-episode batch that leaves --count waiting behind it; until they wait."""
        count = self.args.count
        self.batch(count=1, parallelism=1, warm_pool=count)
        deadline = time.monotonic() + 180 + 3 * count
        while self.target.waiting() < count:
            if time.monotonic() > deadline:
                raise RuntimeError("the pool did not fill")
            time.sleep(0.2)

    def round(self, number: int) -> None:
        """One round, its pool drained before it."""
        args, add = self.args, self.figures.add
        while self.target.waiting():
            time.sleep(0.2)
        if not args.warm_only:
            settle()
            cold, cold_wall, cold_ready = self.batch(count=args.count, parallelism=args.count)
        self.fill()
        # The pool's runners have done their imports: the burst meets a pool at rest.
        waited = settle()
        warm, warm_wall, warm_ready = self.batch(count=args.count, parallelism=args.count)
        handover = [r["timing"].get("handover_seconds") for r in warm["pods"]]
        if len(handover) != args.count or None in handover:
            raise RuntimeError("the warm batch did not take every episode from the pool")
        add("warm claim -> ready p50 ms", statistics.median(handover) * 1000)
        add("warm claim -> ready p95 ms", p95(handover) * 1000)
        add("warm claim -> ready p99 ms", percentile(handover, 0.99) * 1000)
        add("warm submit -> last ready s", warm_ready)
        add("warm submit -> report s", warm_wall)
        print(
            f"round {number + 1}: settled in {waited:.0f} s; warm {warm_wall:.2f} s, "
            f"claim -> ready ms "
            f"{sorted(round(h * 1000) for h in handover)}",
            flush=True,
        )
        if args.warm_only:
            return
        if isinstance(self.target, KubeTarget):
            self.drained(cold_ready)
        pod_ready = [r["pod_to_ready_seconds"] for r in cold["pods"]]
        add("cold Pod created -> ready p50 ms", statistics.median(pod_ready) * 1000)
        add("cold Pod created -> ready p95 ms", p95(pod_ready) * 1000)
        add("cold submit -> last ready s", cold_ready)
        add("cold submit -> report s", cold_wall)
        add("warm / cold submit -> report", warm_wall / cold_wall)

    def drained(self, cold_ready: float) -> None:
        """A batch that finds the pool's namespace empty: it must run cold."""
        settle()  # as before the cold batch: the warm batch's teardown is not its cost
        drained, drained_wall, drained_ready = self.batch(
            count=self.args.count, parallelism=self.args.count
        )
        if any("handover_seconds" in r["timing"] for r in drained["pods"]):
            raise RuntimeError("the drained pool gave a warm Pod")
        self.figures.add("drained submit -> last ready s", drained_ready)
        self.figures.add("drained submit -> report s", drained_wall)
        self.figures.add("drained / cold submit -> last ready", drained_ready / cold_ready)


def main() -> None:
    args = parse_args()
    target = KubeTarget() if args.backend == "kubernetes" else LocalTarget()
    fields, env = batch_shape(args, target)
    with LocalStack(collectors=2, extra_env=env) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        drain = [
            sys.executable,
            "-m",
            "rollout_worker.cli",
            "pools",
            "--backend",
            args.backend,
            "--drain",
        ]
        drain_env = {**os.environ, **env, "ROLLOUT_REDIS_URL": stack.redis_url}
        rounds = Rounds(args, target, client, fields)
        rounds.batch(count=2, parallelism=2)  # warm-up, not measured
        for number in range(args.rounds):
            subprocess.run(drain, env=drain_env, check=True, capture_output=True)
            rounds.round(number)
        subprocess.run(drain, env=drain_env, check=True, capture_output=True)
        client.close()
    threads = args.handover_threads or "default"
    print(
        f"\n{args.count} episodes on {target.where}, {args.rounds} rounds, hand-over threads "
        f"{threads}, resources {fields.get('resources', 'default')}: median [min-max]"
    )
    print(f"  load average after: {os.getloadavg()}")
    for name, values in rounds.figures.values.items():
        digits = 0 if name.endswith("ms") else 2
        print(f"  {name:34} {Stats(values).fmt(digits=digits)}")


if __name__ == "__main__":
    main()

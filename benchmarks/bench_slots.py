"""Every slot busy (issues 26 and 46): a batch of many waves on the real node in episode Pods
and in sandbox hosts, and the local backend on the same batch, side by side in one run.

The batch: the bundled tasks x --samples (18: 162 episodes), the scripted policy answering at
once, --parallelism 10 (about 16 waves), a pool of that many waiting sandboxes before it
(`warm_pool` = parallelism: each batch refills its pool behind itself for the next round; the
benchmark waits, untimed, until the pool has them). Small requests (50m CPU, 64Mi) so the
running Pods and the waiting ones fit the 2-core node.

The sides, each with its own stack (redis-server, a control worker, two collectors):
- pods: today's workers, an episode Pod per episode (a run fed from its pool, slot by slot);
- hosts: today's workers with `isolation: host`: --hosts host Pods (benchmarks/slot_hosts.py)
  holding --parallelism slots between them, bwrap sandboxes inside, episodes through Redis.
  The hosts are started and made ready before the rounds, untimed, and stay up: their idle
  CPU counts in every side's machine CPU, as the pools' refills do;
- local: today's workers on the local backend (bwrap sandboxes), same batch, its own pool;
- before (only with --before REV): the workers of an older checkout (663e2c2 is the commit
  before issue 26), where warm Pods serve a batch's first wave and the rest runs as a Job.
Before the rounds (and before the hosts start), `pod_floor` measures the node's own work per
Pod (bare Pods, no episode) and the idle machine. For each "pods" batch the benchmark then
prints the least wall time any scheduler could give it on this machine: (episodes x the
node's work per Pod + the episodes' own CPU from their cost ledger) / (cores - the idle
machine's busy cores). A goal whose wall time is under that bound cannot be met on this machine
by anything the workers do.
Figures per batch: the machine's busy CPU-seconds per episode (submit -> its Pods torn down,
less the idle machine's), submit -> report, and slot utilisation = the episodes' own seconds (each
row's ready -> finished: the runner's first event to the sandbox's end) / (parallelism x
submit -> the last episode's end). Each round runs every side (the order rotates); a
batch's cleanup ends before the next batch starts. Printed: median [min-max] over rounds, the
sides side by side, and each round's ratios: hosts/local wall and machine CPU, pods/hosts,
pods/local (and pods/before).

`--reports DIR` keeps each timed batch's report (`<side>-round<N>.json`, for `rollout report
--plot` of a round that stands out) and its episodes' logs (`<side>-round<N>.logs.json`: the
runner's events, each policy turn's seconds and attempts among them).

    python -m benchmarks.bench_slots [--rounds 3] [--samples 18] [--parallelism 10]
        [--hosts 1] [--before REV] [--reports DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.bench_tail import ensure_real_node, node_address
from benchmarks.bench_warm import waiting_pods
from benchmarks.harness import Figures, Stats, require_rounds
from benchmarks.pod_floor import Floor, describe, lowest, measure
from benchmarks.proc import machine_busy_seconds, settle
from benchmarks.slot_hosts import HostPoolRun, goal_lines, ratios, side_by_side
from rollout_wire import constants as k
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.backends.host.manifests import Endpoint
from rollout_worker.backends.kube import objects
from rollout_worker.cli.plots import busy_spans, run_origin
from rollout_worker.cli.policy_server import bundled_script, running
from rollout_worker.cli.stack import LocalStack
from rollout_worker.metrics import slot_utilisation
from tests.helm.test_chart_install import kube_images
from trainer_stub.client import RolloutClient

REPO = Path(__file__).resolve().parents[1]
RESOURCES = {"cpu_request": "50m", "memory_request": "64Mi"}


def worktree(rev: str) -> Path:
    path = Path(f"/tmp/rollout-before-{rev}")
    if not (path / "rollout_worker").is_dir():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), rev],
            check=True,
            capture_output=True,
        )
    return path


def utilisation(report: dict[str, Any], parallelism: int, submitted: float) -> float:
    """The report's slot utilisation (the same spans, as `rollout report --plot` draws them),
    counted from the trainer's submit rather than the run's origin."""
    origin = run_origin(report) or 0.0  # busy_spans are in seconds since it
    return slot_utilisation(busy_spans(report), parallelism, submitted - origin) or 0.0


class Side:
    def __init__(
        self,
        name: str,
        stack: LocalStack,
        fields: dict[str, Any],
        cluster: Any,
        hosts: HostPoolRun | None = None,
    ) -> None:
        self.name, self.stack, self.fields, self.cluster = name, stack, fields, cluster
        self.hosts = hosts
        self.client = RolloutClient(stack.redis_url)
        # The machine's busy CPU-seconds and the monotonic clock at the last batch's submit.
        self.busy, self.busy_at = 0.0, 0.0

    def waiting(self) -> int:
        """Waiting sandboxes of the pools this side's workers registered."""
        keys = [key.decode() for key in self.client.redis.hkeys(k.POOLS_KEY)]
        total = 0
        for key in keys:
            if self.cluster is None:
                state = Path(self.stack.dir) / "runs" / "_pools" / key / "state.json"
                if state.exists():
                    total += int(json.loads(state.read_text())["waiting"])
                continue
            total += waiting_pods(self.cluster, objects.pool_namespace(key))
        return total

    def batch(self, parallelism: int, **extra: Any) -> tuple[dict[str, Any], float, float]:
        self.busy, self.busy_at = machine_busy_seconds(), time.monotonic()
        start, clock = time.perf_counter(), time.time()
        submission = self.client.submit(**self.fields, parallelism=parallelism, **extra)
        report = self.client.wait(submission.batch_id, timeout=1800)
        wall = time.perf_counter() - start
        deadline = time.monotonic() + 600
        while self.client.receipt(submission.batch_id).get("cleanup") != "deleted":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: cleanup of {submission.batch_id} did not end")
            time.sleep(0.5)
        if report["successful_episodes"] != report["episodes"]:
            raise RuntimeError(f"{self.name}: batch {submission.batch_id}: {report['status']}")
        return report, wall, clock

    def machine_cpu(self, idle_cores: float) -> float:
        """The machine's busy CPU-seconds since the last batch's submit, less the idle
        machine's, once the node has torn its Pods down: everything the batch cost, ours, the
        node's and the policy server's (the pool's refill for the next round included)."""
        settle()
        elapsed = time.monotonic() - self.busy_at
        return machine_busy_seconds() - self.busy - idle_cores * elapsed

    def pool_ready(self, size: int) -> None:
        if self.hosts is not None:  # every host's slots free again
            self.hosts.ready(self.client.redis)
            return
        deadline = time.monotonic() + 300
        while self.waiting() < size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the pool did not fill to {size}")
            time.sleep(0.5)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=18)
    parser.add_argument("--parallelism", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=1, help="host Pods (the hosts side)")
    parser.add_argument("--before", default=None, help="also run an older checkout's workers")
    parser.add_argument("--reports", type=Path, default=None)
    args = parser.parse_args()
    require_rounds(parser, args.rounds)
    if args.reports is not None:
        args.reports.mkdir(parents=True, exist_ok=True)
    return args


class Rounds:
    """The rounds of the sides, and the figures they gave."""

    def __init__(self, args: argparse.Namespace, floor: Floor, tasks: list[Any]) -> None:
        self.args, self.floor, self.tasks = args, floor, tasks
        self.p = args.parallelism
        self.count = len(tasks) * args.samples
        self.cores = (os.cpu_count() or 1) - floor.idle_cores
        self.figures = Figures()

    def round(self, number: int, sides: list[Side]) -> None:
        walls: dict[str, float] = {}
        turn = number % len(sides)
        for side in sides[turn:] + sides[:turn]:
            walls[side.name] = self.side(number, side)
        cpu = {name: self.figures[f"{name} machine CPU-s per episode"][-1] for name in walls}
        for name, value in ratios(walls, cpu).items():
            self.figures.add(name, value)
            print(f"  round {number + 1} {name}: {value:.2f}", flush=True)

    def side(self, number: int, side: Side) -> float:
        """One side's batch of this round; its wall seconds."""
        p, count, add = self.p, self.count, self.figures.add
        side.pool_ready(p)
        print(f"  round {number + 1} {side.name}: load {os.getloadavg()}", flush=True)
        warm = {} if side.hosts is not None else {"warm_pool": p}
        report, wall, clock = side.batch(
            p, tasks=self.tasks, samples_per_task=self.args.samples, **warm
        )
        if self.args.reports is not None:
            path = self.args.reports / f"{side.name}-round{number + 1}.json"
            path.write_text(json.dumps(report, indent=1))
            logs = side.client.logs(report["batch_id"])
            path.with_suffix(".logs.json").write_text(json.dumps(logs, indent=1))
        warmed = sum(1 for r in report["pods"] if "pool_created_at" in r["timing"])
        used = utilisation(report, p, clock)
        cpu = side.machine_cpu(self.floor.idle_cores)
        add(f"{side.name} machine CPU-s per episode", cpu / count)
        print(f"  round {number + 1} {side.name}: machine {cpu / count:.2f} CPU-s per episode")
        if side.name == "pods":
            self.node_bound(number, report, clock, used)
        add(f"{side.name} submit -> report s", wall)
        add(f"{side.name} slot utilisation", used)
        add(f"{side.name} warm episodes", warmed)
        print(
            f"  round {number + 1} {side.name}: {wall:.1f} s, utilisation "
            f"{used:.2f}, {warmed} of {count} warm",
            flush=True,
        )
        return wall

    def node_bound(self, number: int, report: dict[str, Any], clock: float, used: float) -> None:
        """The least wall any scheduler could give the "pods" batch on this node."""
        p, count, floor = self.p, self.count, self.floor
        own = sum((r.get("cost") or {}).get("cpu_seconds") or 0 for r in report["pods"])
        least = (count * floor.per_pod + own) / self.cores
        self.figures.add("pods: least wall on this node s", least)
        # Were the batch to end at that bound with its episodes as long as they
        # were here, its slots would be this busy (slower episodes, busier slots).
        busy = used * p * (max(r["finished_at"] for r in report["pods"]) - clock)
        self.figures.add("pods: utilisation at that wall", busy / (p * least))
        print(
            f"  round {number + 1} pods: the node's work {count} x "
            f"{floor.per_pod:.3f} CPU-s + the episodes' own {own:.1f} CPU-s over "
            f"{self.cores:.2f} cores: no less than {least:.1f} s",
            flush=True,
        )

    def print_summary(self, sides: list[str]) -> None:
        figures = self.figures
        print(
            f"\n{self.count} episodes, parallelism {self.p}, {self.args.rounds} rounds: "
            "median [min-max]"
        )
        for name, values in figures.values.items():
            digits = 0 if name.endswith("episodes") else 2
            print(f"  {name:32} {Stats(values).fmt(digits=digits)}")
        print()
        for line in side_by_side(figures.values, sides):
            print(f"  {line}")
        medians = {name: figures.median(name) for name in figures.values}
        for line in goal_lines(medians):
            print(f"  {line}")
        least = figures.median("pods: least wall on this node s")
        for other in sides:
            if other != "pods":
                ratio = least / figures.median(f"{other} submit -> report s")
                print(f"  pods / {other} at the node's bound ({least:.1f} s): {ratio:.2f}")
        print(f"  load average after: {os.getloadavg()}")


def kube_fields(cluster: Any, node: Any, policy_port: int) -> dict[str, Any]:
    return node.batch_fields() | {
        "backend": "kubernetes",
        "capacity_check": "warn",
        "resources": RESOURCES,
        "policy": {"url": f"http://{node_address(cluster, node)}:{policy_port}"},
    }


def main() -> None:
    args = parse_args()
    cluster, node = ensure_real_node()
    old = worktree(args.before) if args.before else None
    floor = lowest([measure(cluster, node, pods=30) for _ in range(3)])
    print(f"the node's own work (30 bare Pods, lowest of 3 rounds): {describe(floor)}", flush=True)
    rounds = Rounds(args, floor, bundled_tasks())
    tasks, p = rounds.tasks, rounds.p
    address = node_address(cluster, node)
    kube_env = {"KUBECONFIG": str(cluster.kubeconfig)}
    stacks = {
        "pods": LocalStack(collectors=2, extra_env=kube_env),
        # The host Pods reach this stack's Redis at the node's address, behind a password.
        "hosts": LocalStack(
            collectors=2, extra_env=kube_env, redis_bind=address, password=os.urandom(12).hex()
        ),
        "local": LocalStack(collectors=2, extra_env={"ROLLOUT_LOCAL_ISOLATION": "bwrap"}),
    }
    if old is not None:
        stacks["before"] = LocalStack(
            collectors=2, extra_env=kube_env | {"PYTHONPATH": str(old)}, cwd=str(old)
        )
    image = kube_images()["ROLLOUT_KUBE_HOST_IMAGE"]
    hosts: HostPoolRun | None = None
    with running(host="0.0.0.0", script=bundled_script()) as server:
        try:
            for stack in stacks.values():
                stack.start()
                stack.wait_ready()
            hosts = HostPoolRun.plan(
                cluster,
                node,
                image,
                stacks["hosts"].redis_url_at(address),
                p,
                replicas=args.hosts,
                slot_cpu_request=RESOURCES["cpu_request"],
                policy_egress=(Endpoint(f"{address}/32", server.port),),
            )
            ready = hosts.start(redis.Redis.from_url(stacks["hosts"].redis_url))
            print(f"{args.hosts} host Pods x {hosts.pool.slots} slots ready in {ready:.1f} s")
            fields = kube_fields(cluster, node, server.port)
            local = {"backend": "local", "policy": {"url": f"http://127.0.0.1:{server.port}"}}
            sides = [
                Side("pods", stacks["pods"], fields, cluster),
                Side("hosts", stacks["hosts"], fields | {"isolation": "host"}, None, hosts),
                Side("local", stacks["local"], local, None),
            ]
            if old is not None:
                sides.append(Side("before", stacks["before"], fields, cluster))
            for side in sides:  # warm-up (images, imports) and the first fill: not measured
                warm = {} if side.hosts is not None else {"warm_pool": p}
                side.batch(2, tasks=tasks[:2], **warm)
            print(f"{rounds.count} episodes ({len(tasks)} tasks x {args.samples}), parallelism {p}")
            for number in range(args.rounds):
                rounds.round(number, sides)
            for side in sides:
                side.client.close()
        finally:
            if hosts is not None:
                hosts.stop()
            for stack in stacks.values():
                stack.stop()
    rounds.print_summary([side.name for side in sides])


if __name__ == "__main__":
    main()

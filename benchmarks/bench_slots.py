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
runner's events, each policy turn's seconds and attempts among them). `--sides` runs only some
of pods, hosts and local (all three by default).

The burst (issue 46's goal: a burst of 1,000 one-second episodes, hosts at least 3x faster than
one Pod per episode): `--burst N` times a batch of N episodes instead of the bundled tasks, each
taking about `--episode-seconds` (default 1) in its sandbox: its test sleeps that long, then
passes, so every episode still earns its reward through real grading (benchmarks/burst_tasks.py
builds the batch in process; a round whose episodes were not all graded 1, or whose grading took
less than the sleep, fails). The warm-up, the pools, the hosts and the node's floor are as above.
Printed besides: each side's episodes per second and median grading seconds, and instead of the
goals above, `goal burst: hosts >= 3x faster than pods` on the median of the rounds' pods / hosts
wall ratio.

The issue's batch (its first goal: "164 short single-file Python tasks, one sample each, a
policy that answers right at once, parallelism 10": hosts within 1.3x local's wall and 1.2x its
CPU per episode): `--distinct 164` times 164 distinct tasks instead, one sample each, generated
in process (benchmarks/distinct_tasks.py: a function per task, broken or not yet written, its
hidden tests counted by the grader's harness). The scripted policy is given each task's right
file, which it writes in the agent's first turn; a round whose episodes did not each earn reward
1 with all their tests run and passed, one episode per task, fails. The goals printed are the
issue's first: `hosts / local` wall <= 1.3 and machine CPU per episode <= 1.2.

    python -m benchmarks.bench_slots [--rounds 3] [--samples 18] [--parallelism 10]
        [--hosts 1] [--before REV] [--reports DIR] [--sides pods,hosts,local]
    python -m benchmarks.bench_slots --burst 1000 --episode-seconds 1 --parallelism 10
        --rounds 3 --sides pods,hosts
    python -m benchmarks.bench_slots --distinct 164 --parallelism 10 --rounds 3
        --sides hosts,local
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
from benchmarks.burst_tasks import (
    burst_limits,
    burst_problems,
    burst_tasks,
    check_burst_args,
    grading_seconds,
)
from benchmarks.distinct_tasks import (
    check_distinct_args,
    distinct_problems,
    distinct_tasks,
    policy_script,
)
from benchmarks.harness import Figures, Stats, new_parser, require_rounds
from benchmarks.pod_floor import Floor, describe, lowest, measure
from benchmarks.proc import machine_busy_seconds, settle
from benchmarks.slot_hosts import (
    BURST_GOALS,
    DISTINCT_GOALS,
    GOALS,
    HostPoolRun,
    goal_lines,
    ratios,
    side_by_side,
)
from rollout_wire import constants as k
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.backends.host.manifests import Endpoint
from rollout_worker.backends.kube import objects
from rollout_worker.cli.plots import busy_spans, run_origin
from rollout_worker.cli.policy_server import running
from rollout_worker.cli.stack import LocalStack
from rollout_worker.metrics import slot_utilisation
from tests.helm.test_chart_install import kube_images
from trainer_stub.client import RolloutClient

REPO = Path(__file__).resolve().parents[1]
RESOURCES = {"cpu_request": "50m", "memory_request": "64Mi"}
SIDES = ("pods", "hosts", "local")


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

    def batch(
        self, parallelism: int, timeout: float = 1800, **extra: Any
    ) -> tuple[dict[str, Any], float, float]:
        self.busy, self.busy_at = machine_busy_seconds(), time.monotonic()
        start, clock = time.perf_counter(), time.time()
        submission = self.client.submit(**self.fields, parallelism=parallelism, **extra)
        report = self.client.wait(submission.batch_id, timeout=timeout)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=None, help="default 18")
    parser.add_argument("--parallelism", type=int, default=10)
    parser.add_argument("--hosts", type=int, default=1, help="host Pods (the hosts side)")
    parser.add_argument("--before", default=None, help="also run an older checkout's workers")
    parser.add_argument("--reports", type=Path, default=None)
    parser.add_argument(
        "--burst", type=int, default=None, metavar="N", help="a burst of N episodes instead"
    )
    parser.add_argument(
        "--episode-seconds", type=float, default=None, help="a burst test's sleep (default 1)"
    )
    parser.add_argument(
        "--distinct", type=int, default=None, metavar="N", help="N generated tasks instead"
    )
    parser.add_argument("--sides", default=",".join(SIDES), help="of " + ",".join(SIDES))
    args = parser.parse_args(argv)
    require_rounds(parser, args.rounds)
    check_burst_args(parser, args)
    check_distinct_args(parser, args)
    if args.samples is None:
        args.samples = 18
    args.sides = sides_of(parser, args.sides)
    if args.reports is not None:
        args.reports.mkdir(parents=True, exist_ok=True)
    return args


def sides_of(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """--sides: a comma-separated subset of SIDES, in SIDES' order."""
    named = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(named) - set(SIDES))
    if unknown or not named:
        parser.error(f"--sides {text!r}: name one or more of {','.join(SIDES)}")
    return [name for name in SIDES if name in named]


def timed_batch(args: argparse.Namespace) -> tuple[list[Any], int, dict[str, Any]]:
    """Each timed batch's tasks, samples per task and other request fields: the bundled tasks,
    the distinct tasks (benchmarks/distinct_tasks.py) one sample each, or the burst
    (benchmarks/burst_tasks.py) with its timeout and deadline."""
    if args.distinct is not None:
        return [g.task for g in distinct_tasks(args.distinct)], 1, {}
    if args.burst is None:
        return bundled_tasks(), args.samples, {}
    tasks, samples = burst_tasks(args.burst, args.episode_seconds)
    return tasks, samples, burst_limits(tasks, args.burst, args.parallelism, args.episode_seconds)


class Rounds:
    """The rounds of the sides, and the figures they gave."""

    def __init__(self, args: argparse.Namespace, floor: Floor) -> None:
        self.args, self.floor = args, floor
        self.tasks, self.samples, self.extra = timed_batch(args)
        # What the policy answers: the bundled tasks' plans, and the distinct tasks' files.
        self.generated = distinct_tasks(args.distinct) if args.distinct is not None else []
        self.script = policy_script(self.generated)
        # A burst may take up to its deadline (its report comes by then, whatever happened).
        deadline = self.extra.get("deadline_seconds")
        self.timeout = 1800 if deadline is None else deadline + 300
        self.p = args.parallelism
        self.count = len(self.tasks) * self.samples
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
            p, self.timeout, tasks=self.tasks, samples_per_task=self.samples, **self.extra, **warm
        )
        if self.args.reports is not None:  # kept first: a round that fails below is looked at
            path = self.args.reports / f"{side.name}-round{number + 1}.json"
            path.write_text(json.dumps(report, indent=1))
            logs = side.client.logs(report["batch_id"])
            path.with_suffix(".logs.json").write_text(json.dumps(logs, indent=1))
        if self.args.burst is not None:
            self.burst_figures(number, side.name, report, wall)
        if self.generated:  # each task's one episode graded 1 by all its hidden tests
            problems = distinct_problems(report, self.generated)
            if problems:
                raise RuntimeError(f"{side.name}: {len(problems)} problems: {problems[:5]}")
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

    def burst_figures(self, number: int, name: str, report: dict[str, Any], wall: float) -> None:
        """A burst's episodes were graded as built (else the round fails), and how fast."""
        seconds = self.args.episode_seconds
        problems = burst_problems(report, seconds)
        if problems:
            raise RuntimeError(f"{name}: {len(problems)} episodes not as built: {problems[:5]}")
        self.figures.add(f"{name} episodes per s", self.count / wall)
        tests = grading_seconds(report)
        if tests is not None:
            self.figures.add(f"{name} grading s per episode", tests)
        print(f"  round {number + 1} {name}: {self.count / wall:.2f} episodes per s", flush=True)

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
        burst = self.args.burst is not None
        goals = BURST_GOALS if burst else DISTINCT_GOALS if self.generated else GOALS
        for line in goal_lines(medians, goals):
            print(f"  {line}")
        if burst:  # no side is faster than its slots, each busy the episodes' own seconds
            least = self.count * self.args.episode_seconds / self.p
            print(f"  burst: no side can take less than {self.count} x ", end="")
            print(f"{self.args.episode_seconds} s / {self.p} slots = {least:.1f} s")
        if "pods" in sides:
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


def make_stacks(
    args: argparse.Namespace, cluster: Any, address: str, old: Path | None
) -> dict[str, LocalStack]:
    """Each side's stack (redis-server, a control worker, two collectors)."""
    kube_env = {"KUBECONFIG": str(cluster.kubeconfig)}
    stacks = {}
    if "pods" in args.sides:
        stacks["pods"] = LocalStack(collectors=2, extra_env=kube_env)
    if "hosts" in args.sides:
        # The host Pods reach this stack's Redis at the node's address, behind a password.
        stacks["hosts"] = LocalStack(
            collectors=2, extra_env=kube_env, redis_bind=address, password=os.urandom(12).hex()
        )
    if "local" in args.sides:
        stacks["local"] = LocalStack(collectors=2, extra_env={"ROLLOUT_LOCAL_ISOLATION": "bwrap"})
    if old is not None:
        stacks["before"] = LocalStack(
            collectors=2, extra_env=kube_env | {"PYTHONPATH": str(old)}, cwd=str(old)
        )
    return stacks


def make_sides(
    args: argparse.Namespace,
    cluster: Any,
    node: Any,
    stacks: dict[str, LocalStack],
    image: str,
    policy_port: int,
    pools: list[HostPoolRun],
) -> list[Side]:
    """The sides on their started stacks; the hosts side's pool started and ready (it goes
    into `pools` before it starts, for the caller to stop whatever happens)."""
    address = node_address(cluster, node)
    fields = kube_fields(cluster, node, policy_port)
    sides = []
    if "pods" in stacks:
        sides.append(Side("pods", stacks["pods"], fields, cluster))
    if "hosts" in stacks:
        hosts = HostPoolRun.plan(
            cluster,
            node,
            image,
            stacks["hosts"].redis_url_at(address),
            args.parallelism,
            replicas=args.hosts,
            slot_cpu_request=RESOURCES["cpu_request"],
            policy_egress=(Endpoint(f"{address}/32", policy_port),),
        )
        pools.append(hosts)
        ready = hosts.start(redis.Redis.from_url(stacks["hosts"].redis_url))
        print(f"{args.hosts} host Pods x {hosts.pool.slots} slots ready in {ready:.1f} s")
        sides.append(Side("hosts", stacks["hosts"], fields | {"isolation": "host"}, None, hosts))
    if "local" in stacks:
        local = {"backend": "local", "policy": {"url": f"http://127.0.0.1:{policy_port}"}}
        sides.append(Side("local", stacks["local"], local, None))
    if "before" in stacks:
        sides.append(Side("before", stacks["before"], fields, cluster))
    return sides


def main() -> None:
    args = parse_args()
    cluster, node = ensure_real_node()
    old = worktree(args.before) if args.before else None
    floor = lowest([measure(cluster, node, pods=30) for _ in range(3)])
    print(f"the node's own work (30 bare Pods, lowest of 3 rounds): {describe(floor)}", flush=True)
    rounds = Rounds(args, floor)
    p = rounds.p
    stacks = make_stacks(args, cluster, node_address(cluster, node), old)
    image = kube_images()["ROLLOUT_KUBE_HOST_IMAGE"]
    pools: list[HostPoolRun] = []
    with running(host="0.0.0.0", script=rounds.script) as server:
        try:
            for stack in stacks.values():
                stack.start()
                stack.wait_ready()
            sides = make_sides(args, cluster, node, stacks, image, server.port, pools)
            for side in sides:  # warm-up (images, imports) and the first fill: not measured
                warm = {} if side.hosts is not None else {"warm_pool": p}
                side.batch(2, tasks=bundled_tasks()[:2], **warm)
            print(
                f"{rounds.count} episodes ({len(rounds.tasks)} tasks x {rounds.samples}), "
                f"parallelism {p}"
            )
            for number in range(args.rounds):
                rounds.round(number, sides)
            for side in sides:
                side.client.close()
        finally:
            for pool in pools:
                pool.stop()
            for stack in stacks.values():
                stack.stop()
    rounds.print_summary([side.name for side in sides])


if __name__ == "__main__":
    main()

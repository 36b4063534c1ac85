"""The cost ledger (issue 27): what reading it costs, and whether its CPU-seconds are right.

Goals: the ledger's own reading costs at most 2% of the episode's CPU, and the ledger's
CPU-seconds agree within 5% with an outside measurement, read by this benchmark.

Each round runs one batch of --count episodes (default 8) at --parallelism (default 2) on the
local backend in bubblewrap sandboxes (a LocalStack: redis-server, a control worker, two
collectors; ROLLOUT_LOCAL_ISOLATION=bwrap), with the scripted policy in this process. Every
episode is the same task: its one agent turn runs `python -B burn.py`, a loop that spins until
its own process has used --burn-seconds of CPU (it reads its own clock, so the work is the same
whatever the machine's speed or load), then it submits and its one test passes. With the
runner, the tool call and the tests that makes about 2 CPU-seconds an episode, so the reading
and the accounting noise are small against it.

- The ledger: the rows' `cost` (what the runner read over /proc of its sandbox's PID
  namespace just before its reward event): the sum of `cpu_seconds`, and of
  `ledger_cpu_seconds`, the CPU that reading took.
- Outside: this process makes itself a child subreaper (benchmarks/proc.py). The run's
  supervisor is double-forked away from the worker that starts it and is re-parented here; each
  of its sandboxes is an outer bwrap (the supervisor's child, which it reaps) and an inner bwrap,
  PID 1 of the sandbox's PID namespace, which reaps every process of the episode. The outer one
  exits without reaping the inner one, so the inner bwrap is re-parented here too, and
  `proc.Meter` reaps it with wait4(2): its rusage is the CPU of every process the namespace
  ever had (in microseconds, not clock ticks), the same scope as the ledger. This benchmark reuses
  Meter (its reaping, its wait for the supervisor, its sampler) and keeps what each reap gave:
  the outside figure is the sum over the reaped processes named bwrap that are not
  supervisors. Each is tied to its episode by the `EPISODE_ID` on its command line (the inner
  bwrap is a fork of the outer one, never exec'd), seen by the sampler while it ran; that gives
  each row's own ledger / outside as well. Not the episode, so not in it: the supervisor, the
  workers, Redis, and the outer bwraps (outside the namespace; their CPU is in what the
  supervisor reaped, Meter's `sandboxes` minus the inner ones), printed apart. Should fewer
  inner bwraps than episodes be reaped here (a bwrap that reaps its PID 1 itself), the round's
  outside figure is Meter's `sandboxes`, outer bwraps included, and a note says so.

The ledger is read before its runner exits: the reward event's printing and the runner's exit
are in the outside figure only, so ledger / outside sits a little under 1. Per round: the two
totals and their ratio (goal: |ratio - 1| <= 0.05), the per-episode ratios' range, the
overhead sum(ledger_cpu_seconds) / sum(cpu_seconds) (goal: <= 0.02), the median episode's
cpu_seconds. Printed: median [min-max] over rounds (at least 3; a warm-up batch before them is
not counted), the load average at start and end, whether each goal was met. Only CPU time is
compared, so another load on the machine slows the batches but does not move the figures much.

    python -m benchmarks.bench_cost [--rounds 3] [--count 8] [--parallelism 2]
        [--burn-seconds 1.8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    Figures,
    Loads,
    new_parser,
    redis_pid,
    require_rounds,
    worker_roles,
)
from benchmarks.proc import Meter, Proc, Sampler, SandboxEvidence, Usage, become_subreaper
from rollout_wire.states import Cleanup
from rollout_worker.cli.policy_server import running
from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

GOAL_OVERHEAD = 0.02  # sum(ledger_cpu_seconds) / sum(cpu_seconds), at most
GOAL_AGREEMENT = 0.05  # |ledger / outside - 1|, at most
TASK_ID = "burn"
PASSING_TEST = (
    "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n\n\n"
    "if __name__ == '__main__':\n    unittest.main()\n"
)
SCRIPT = {
    "tasks": {
        TASK_ID: {
            "plans": [
                [
                    {"tool": "run", "arguments": {"command": "python -B burn.py"}},
                    {"tool": "submit", "arguments": {}},
                ]
            ]
        }
    }
}


def burn_program(seconds: float) -> str:
    """A loop that stops once its own process has used `seconds` of CPU."""
    return (
        "import time\n"
        "start = time.process_time()\n"
        f"while time.process_time() - start < {seconds}:\n"
        "    sum(range(10000))  # arithmetic between clock reads (each one a system call)\n"
    )


def burn_task(seconds: float) -> dict[str, Any]:
    return {
        "id": TASK_ID,
        "statement": "Run burn.py, then submit.",
        "files": {"burn.py": burn_program(seconds)},
        "test_files": {"test_ok.py": PASSING_TEST},
        "test_command": ["python", "-B", "test_ok.py"],
        "baseline": False,
        "max_steps": 10,
    }


def episode_of(argv: Sequence[bytes]) -> str | None:
    """The episode a bwrap command line sandboxes: its `--setenv EPISODE_ID <id>`."""
    for i in range(len(argv) - 2):
        if argv[i] == b"--setenv" and argv[i + 1] == b"EPISODE_ID":
            return argv[i + 2].decode(errors="replace")
    return None


class EpisodeSampler(Sampler):
    """proc.Sampler that also notes the episode of every bwrap of the run it sees (pid ->
    EPISODE_ID, the row's `pod`); the inner bwrap has the outer one's command line."""

    def __init__(self, marker: str, launcher_sids: set[int]) -> None:
        super().__init__(marker, launcher_sids)
        self.episodes: dict[int, str] = {}

    def sample(self) -> dict[int, Proc]:
        procs = super().sample()
        for proc in procs.values():
            if (
                proc.pid not in self.episodes
                and proc.argv
                and proc.argv[0].endswith(b"bwrap")
                and any(self.marker in a for a in proc.argv)
            ):
                episode = episode_of(proc.argv)
                if episode is not None:
                    self.episodes[proc.pid] = episode
        return procs


class CostMeter(Meter):
    """proc.Meter over a LocalStack's workers, keeping what each of its reaps gave (pid ->
    (comm, CPU seconds of it and all it reaped)) and the episode of each bwrap seen."""

    def __init__(self, stack: LocalStack) -> None:
        roles = worker_roles(stack)
        assert roles["control"] and roles["collectors"]
        super().__init__(roles, redis_pid(stack), str(stack.dir))
        self.episode_sampler = EpisodeSampler(str(stack.dir), self.sampler.launcher_sids)
        self.sampler = self.episode_sampler
        self.reaped: dict[int, tuple[str, float]] = {}

    def start(self) -> CostMeter:
        super().start()
        self.reaped.clear()  # what start() reaped was left over from before the window
        return self

    def reap(self) -> dict[int, tuple[str, float]]:
        got = super().reap()
        self.reaped.update(got)
        return got

    def inner_bwraps(self) -> dict[int, float]:
        """The sandboxes' inner bwraps reaped in this window (after `stop()`): pid -> CPU
        seconds of the sandbox's PID namespace, all of it."""
        supervisors = set(self.sampler.supervisors)
        return {
            pid: cpu
            for pid, (comm, cpu) in self.reaped.items()
            if comm == "bwrap" and pid not in supervisors
        }


@dataclass
class Batch:
    rows: list[dict[str, Any]]
    wall: float
    usage: Usage  # Meter's figures by role
    inner: dict[int, float]  # inner bwrap pid -> CPU seconds (wait4)
    episodes: dict[int, str]  # bwrap pid -> episode id, as the sampler saw them
    evidence: SandboxEvidence


def run_batch(
    stack: LocalStack, client: RolloutClient, fields: dict[str, Any], count: int, parallelism: int
) -> Batch:
    meter = CostMeter(stack).start()
    start = time.perf_counter()
    submission = client.submit(**fields, samples_per_task=count, parallelism=parallelism)
    report = client.wait(submission.batch_id, timeout=600 + 60 * count)
    wall = time.perf_counter() - start
    usage, evidence = meter.stop()  # until the run's supervisor and sandboxes are reaped
    deadline = time.monotonic() + 300
    while client.receipt(submission.batch_id).get("cleanup") not in (
        Cleanup.DELETED,
        Cleanup.KEPT,
        Cleanup.FAILED,
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"cleanup of {submission.batch_id} did not end")
        time.sleep(0.5)
    episodes = report.get("episodes")
    if episodes != count or report.get("successful_episodes") != episodes:
        errors = (report.get("errors") or [])[:3]
        raise RuntimeError(f"batch {submission.batch_id} {report.get('status')}: {errors}")
    if report.get("run_isolation") != "bwrap":
        raise RuntimeError(f"not run in bubblewrap: {report.get('run_isolation')}")
    rows = report["pods"]
    for row in rows:
        cost = row.get("cost") or {}
        if cost.get("cpu_source") != "proc" or not cost.get("cpu_seconds"):
            raise RuntimeError(f"episode {row.get('pod')} has no ledger from /proc: {cost}")
        if cost.get("ledger_cpu_seconds") is None:
            raise RuntimeError(f"episode {row.get('pod')} has no ledger_cpu_seconds: {cost}")
    evidence.assert_bwrap()
    return Batch(
        rows, wall, usage, meter.inner_bwraps(), dict(meter.episode_sampler.episodes), evidence
    )


def furthest_from_one(values: list[float]) -> float:
    return max(values, key=lambda v: abs(v - 1))


def parse_args() -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=8, help="episodes per batch")
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument(
        "--burn-seconds", type=float, default=1.8, help="CPU-seconds of each episode's loop"
    )
    args = parser.parse_args()
    require_rounds(parser, args.rounds)
    if args.count < 1 or args.parallelism < 1 or args.burn_seconds <= 0:
        parser.error("--count and --parallelism must be at least 1, --burn-seconds above 0")
    return args


def per_episode_ratios(batch: Batch, costs: dict[str, dict[str, Any]]) -> list[float]:
    """Each row's ledger / its sandbox's inner bwrap(s), by the EPISODE_ID the sampler saw."""
    per_episode: dict[str, float] = {}
    for pid, cpu in batch.inner.items():
        episode = batch.episodes.get(pid)
        if episode is not None:
            per_episode[episode] = per_episode.get(episode, 0.0) + cpu
    matched = [pod for pod in costs if per_episode.get(pod)]
    return [costs[pod]["cpu_seconds"] / per_episode[pod] for pod in matched]


def measure_round(
    batch: Batch, number: int, count: int, figures: Figures, notes: list[str]
) -> None:
    """One round's figures into `figures`, its notes into `notes`, and its line printed."""
    costs = {row["pod"]: row["cost"] for row in batch.rows}
    ledger = sum(c["cpu_seconds"] for c in costs.values())
    reading = sum(c["ledger_cpu_seconds"] for c in costs.values())
    namespace = sum(batch.inner.values())
    # Every sandbox's inner bwrap reaped here: the namespaces' CPU, exactly. Otherwise
    # (a bwrap that reaps its inner process itself) all the bwraps' CPU as Meter counts
    # it, the outer ones included: what the supervisors reaped less their own CPU.
    whole = len(batch.inner) >= count
    outside = namespace if whole else batch.usage.sandboxes
    if not whole:
        notes.append(
            f"round {number + 1}: only {len(batch.inner)} inner bwraps were reaped here: "
            "outside is all bwrap CPU (Meter's `sandboxes`, outer bwraps included)"
        )
    ratios = per_episode_ratios(batch, costs)
    retried = sum(1 for row in batch.rows if row.get("retried"))
    if len(ratios) < len(costs) or retried:
        notes.append(
            f"round {number + 1}: {len(ratios)} of {len(costs)} rows tied to their "
            f"sandbox, {retried} retried (a retried attempt's sandbox is in the outside "
            "figure only)"
        )
    outer = batch.usage.sandboxes - namespace  # outer bwraps (the supervisors reaped)
    ratio = ledger / outside if outside > 0 else float("nan")
    overhead = reading / ledger
    worst_overhead = max(c["ledger_cpu_seconds"] / c["cpu_seconds"] for c in costs.values())
    episode_cpu = statistics.median(c["cpu_seconds"] for c in costs.values())
    figures.add("batch submit -> report s", batch.wall)
    figures.add("ledger CPU-s (rows' cpu_seconds)", ledger)
    figures.add("outside CPU-s (inner bwraps, wait4)", outside)
    figures.add("ledger / outside", ratio)
    if ratios:
        figures.add("per episode: ledger / outside, worst", furthest_from_one(ratios))
    if batch.usage.sandboxes > 0:
        figures.add("ledger / all bwrap CPU (outer too)", ledger / batch.usage.sandboxes)
    figures.add("outer bwraps CPU-s (not in namespace)", outer)
    figures.add("supervisor CPU-s (own, not episode)", batch.usage.supervisors)
    figures.add("ledger reading CPU-s", reading)
    figures.add("ledger overhead %", overhead)
    figures.add("per episode: worst ledger overhead %", worst_overhead)
    figures.add("episode cpu_seconds, median", episode_cpu)
    shown = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
    print(
        f"round {number + 1}: {len(costs)} episodes in {batch.wall:.1f} s; ledger "
        f"{ledger:.2f} CPU-s, outside {outside:.2f} CPU-s ({len(batch.inner)} sandboxes "
        f"reaped), ledger/outside {ratio:.3f} (per episode {shown}); overhead "
        f"{overhead:.4%} (worst episode {worst_overhead:.4%}); episode CPU median "
        f"{episode_cpu:.2f} s; outer bwraps {outer:.3f} CPU-s; load {os.getloadavg()}",
        flush=True,
    )


def print_summary(
    args: argparse.Namespace,
    figures: Figures,
    notes: list[str],
    evidence: list[SandboxEvidence],
    loads: Loads,
) -> None:
    print(
        f"\n{args.count} episodes a batch, parallelism {args.parallelism}, {args.rounds} rounds: "
        "median [min-max]"
    )
    for line in figures.lines(width=40, digits=3):
        print(line)
    for note in notes:
        print(f"  note: {note}")
    print(f"  every round ran in bubblewrap; round 1: {evidence[0].describe()}")
    agreement = figures.median("ledger / outside")
    overhead = figures.median("ledger overhead %")
    met = abs(agreement - 1) <= GOAL_AGREEMENT
    print(
        f"  goal |ledger / outside - 1| <= {GOAL_AGREEMENT:.2f}: {'met' if met else 'MISSED'} "
        f"({agreement:.3f}; rounds {min(figures['ledger / outside']):.3f}-"
        f"{max(figures['ledger / outside']):.3f})"
    )
    met = overhead <= GOAL_OVERHEAD
    print(
        f"  goal ledger overhead <= {GOAL_OVERHEAD:.2%}: {'met' if met else 'MISSED'} "
        f"({overhead:.4%})"
    )
    print(f"  {loads.line()}")


def main() -> None:
    args = parse_args()
    loads = Loads()
    print(
        f"{os.cpu_count()} cpus, load average at start {loads.start}; {args.count} episodes a "
        f"batch, parallelism {args.parallelism}, a {args.burn_seconds} CPU-s loop each",
        flush=True,
    )
    become_subreaper()  # the supervisors and the inner bwraps come back to us, to be reaped
    figures = Figures()
    notes: list[str] = []
    evidence: list[SandboxEvidence] = []
    with (
        running(script=SCRIPT) as server,
        LocalStack(collectors=2, extra_env={"ROLLOUT_LOCAL_ISOLATION": "bwrap"}) as stack,
    ):
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        fields = {
            "backend": "local",
            "tasks": [burn_task(args.burn_seconds)],
            "policy": {"url": server.url},
        }
        run_batch(stack, client, fields, 2, 2)  # warm-up, not counted
        for number in range(args.rounds):
            batch = run_batch(stack, client, fields, args.count, args.parallelism)
            evidence.append(batch.evidence)
            measure_round(batch, number, args.count, figures, notes)
        client.close()
    print_summary(args, figures, notes, evidence, loads.stop())


if __name__ == "__main__":
    main()

"""Benchmarks on this machine (not tests): each figure is the median of --runs runs [min-max].

1. Orchestration cost: our pipeline (submit -> report) collecting N local episodes, against
   - a no-op Celery chord of N tasks on workers of the same shape (header tasks on
     `--collectors` thread-pool workers of `--collect-concurrency` slots, the callback on a
     prefork worker of `--control-concurrency`, as the pipeline's collectors and control
     worker), and
   - the local backend alone (no Celery) running the same N episodes.
   CPU is that of every process of ours that works for the batch: control worker and its
   children, collectors, the local supervisors and the sandboxes they run (see proc.py); Redis
   is shown next to it, and the benchmark process (the trainer side) apart.
2. Sandbox cost: the local backend (bwrap + supervisor) against a bare process pool running the
   same episode program, at the same parallelism. Every local run must be seen running in
   bubblewrap sandboxes (own pid/user/net namespaces, uid 1000 inside) or the benchmark fails.

    python -m benchmarks.bench_pipeline [--episodes 100] [--parallelism 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from celery import chord

from benchmarks.harness import Stats, new_parser, redis_pid, worker_roles
from benchmarks.proc import Meter, SandboxEvidence, Usage, become_subreaper
from rollout_wire.request import parse_spec
from rollout_worker.backends.local.backend import LocalBackend
from rollout_worker.cli.stack import LocalStack
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings
from trainer_stub.client import RolloutClient

ROOT = Path(__file__).resolve().parent.parent


# -- 1a. the no-op chord floor ---------------------------------------------------------------
class NoopWorkers:
    """Workers for benchmarks.noop_app shaped like the stack's: thread-pool header workers and a
    prefork callback worker, with the same slots, log level and flags as `rollout worker`."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.control: list[subprocess.Popen[bytes]] = []
        self.collectors: list[subprocess.Popen[bytes]] = []

    def _start(self, queue: str, name: str, pool: str, concurrency: int) -> subprocess.Popen:
        log = open(self.stack.dir / f"worker-{name}.log", "wb")  # noqa: SIM115 - the child's
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "benchmarks.noop_app",
                "worker",
                "-Q",
                queue,
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-n",
                f"{name}@%h",
                # As `rollout worker` starts the stack's workers.
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
            ],
            env=self.stack.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def __enter__(self) -> NoopWorkers:
        from benchmarks.noop_app import app

        stack = self.stack
        self.control.append(
            self._start("bench_control", "benchcontrol", "prefork", stack.control_concurrency)
        )
        for n in range(stack.collectors):
            self.collectors.append(
                self._start(
                    "bench_collect", f"benchcollect{n + 1}", "threads", stack.collect_concurrency
                )
            )
        names = {f"benchcontrol@{socket.gethostname()}"} | {
            f"benchcollect{n + 1}@{socket.gethostname()}" for n in range(stack.collectors)
        }
        end = time.monotonic() + 60
        while not names <= {n for reply in app.control.ping(timeout=1.0) or [] for n in reply}:
            assert time.monotonic() < end, f"no-op workers not ready: {names}"
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.control + self.collectors:
            proc.terminate()
        for proc in self.control + self.collectors:
            proc.wait(30)


def noop_chord(stack: LocalStack, workers: NoopWorkers, n: int) -> tuple[float, Usage]:
    from benchmarks.noop_app import done, noop

    meter = Meter(
        {
            "control": [p.pid for p in workers.control],
            "collectors": [p.pid for p in workers.collectors],
        },
        redis_pid(stack),
        str(stack.dir),
    ).start()
    start = time.perf_counter()
    header = [noop.s(i).set(queue="bench_collect") for i in range(n)]
    result = chord(header)(done.s().set(queue="bench_control"))
    # Wait on the callback only: following parents would poll every header task.
    count = result.get(timeout=600, follow_parents=False)
    elapsed = time.perf_counter() - start
    usage, _ = meter.stop()
    assert count == n
    return elapsed, usage


# -- 1b. the pipeline ------------------------------------------------------------------------
def stack_meter(stack: LocalStack) -> Meter:
    roles = worker_roles(stack)
    assert roles["control"] and roles["collectors"]
    return Meter(roles, redis_pid(stack), str(stack.dir))


def pipeline(
    stack: LocalStack, n: int, parallelism: int
) -> tuple[float, dict, Usage, SandboxEvidence]:
    client = RolloutClient(stack.redis_url)
    meter = stack_meter(stack).start()
    start = time.perf_counter()
    submission = client.submit(count=n, parallelism=parallelism)
    report = client.wait(submission.batch_id, timeout=900)
    elapsed = time.perf_counter() - start
    # Until the run's supervisor has exited (the report can come a moment before).
    usage, evidence = meter.stop()
    assert report["ok"] and report["reward_sum"] == n, report["errors"][:3]
    assert report["run_isolation"] == "bwrap", report.get("warnings")
    client.close()
    return elapsed, report, usage, evidence


# -- 1c / 2. the local backend alone and a bare pool --------------------------------------------
def backend_alone(n: int, parallelism: int) -> tuple[float, Usage, SandboxEvidence]:
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as root:
        backend = LocalBackend(Settings(local_root=Path(root)))
        spec = parse_spec({"count": n, "parallelism": parallelism}, max_episodes=n)
        meter = Meter({}, None, root).start()
        start = time.perf_counter()
        handle = backend.start_run(spec, lambda _: None)
        for index in range(n):
            assert backend.wait_episode(handle, index, 600).phase == "Succeeded"
        elapsed = time.perf_counter() - start
        usage, evidence = meter.stop()
        assert handle.isolation == "bwrap"
        backend.delete_run(handle)
    return elapsed, usage, evidence


def bare_pool(n: int, parallelism: int) -> tuple[float, float]:
    """The same episode program as plain subprocesses: no sandbox, no supervisor, no limits.
    Returns (seconds, CPU seconds of the children)."""
    with tempfile.TemporaryDirectory() as root:
        program = Path(root) / "episode.py"
        program.write_text(episode_program_text())

        def one(index: int) -> int:
            workspace = Path(root) / str(index)
            workspace.mkdir()
            env = {
                "EPISODE_ID": f"bare-{index}",
                "ROLLOUT_WORKSPACE": str(workspace),
                "PATH": os.environ["PATH"],
            }
            # A session of its own, as each sandbox has (bwrap --new-session): with the
            # kernel's autogroup scheduling a session is a scheduling group, and under load from
            # other sessions one shared group would run slower than one group per episode.
            return subprocess.run(
                ["/usr/bin/python3", "-B", str(program)],
                env=env,
                capture_output=True,
                check=False,
                start_new_session=True,
            ).returncode

        before = os.times()
        start = time.perf_counter()
        with ThreadPoolExecutor(parallelism) as pool:
            codes = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - start
        after = os.times()
    assert codes == [0] * n
    cpu = (after.children_user + after.children_system) - (
        before.children_user + before.children_system
    )
    return elapsed, cpu


# -- output ----------------------------------------------------------------------------------
def line(label: str, stats: Stats, per: int, unit: str, scale: float = 1000.0) -> None:
    per_unit = Stats([v / per * scale for v in stats.values])
    print(f"  {label:<44} {stats.fmt():>24}   {per_unit.fmt():>24} {unit}")


def parse_args() -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--parallelism", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    # The stack's own shape by default (LocalStack, as `rollout run --all-in-one` starts it).
    shape = {f.name: f.default for f in dataclasses.fields(LocalStack)}
    parser.add_argument("--collectors", type=int, default=shape["collectors"])
    parser.add_argument("--collect-concurrency", type=int, default=shape["collect_concurrency"])
    parser.add_argument("--control-concurrency", type=int, default=shape["control_concurrency"])
    args = parser.parse_args()
    assert args.runs >= 3, "a figure is a median of at least 3 runs"
    return args


@dataclasses.dataclass
class Runs:
    """Every run's wall seconds and CPU, by what ran."""

    noop_t: list[float] = dataclasses.field(default_factory=list)
    noop_u: list[Usage] = dataclasses.field(default_factory=list)
    pipe_t: list[float] = dataclasses.field(default_factory=list)
    pipe_u: list[Usage] = dataclasses.field(default_factory=list)
    latency: list[float] = dataclasses.field(default_factory=list)
    alone_t: list[float] = dataclasses.field(default_factory=list)
    alone_u: list[Usage] = dataclasses.field(default_factory=list)
    bare_t: list[float] = dataclasses.field(default_factory=list)
    bare_cpu: list[float] = dataclasses.field(default_factory=list)
    evidence: list[SandboxEvidence] = dataclasses.field(default_factory=list)


def on_the_stack(args: argparse.Namespace, runs: Runs) -> None:
    """The no-op chord and the pipeline, on one LocalStack."""
    n, p = args.episodes, args.parallelism
    env = {"PYTHONPATH": str(ROOT), "ROLLOUT_MAX_BATCH_EPISODES": str(max(n, 1000))}
    with LocalStack(
        collectors=args.collectors,
        collect_concurrency=args.collect_concurrency,
        control_concurrency=args.control_concurrency,
        extra_env=env,
    ) as stack:
        stack.wait_ready()
        os.environ["ROLLOUT_REDIS_URL"] = stack.redis_url  # read by noop_app at import
        with NoopWorkers(stack) as workers:
            noop_chord(stack, workers, 20)  # warm-up, not counted
            for _ in range(args.runs):
                elapsed, usage = noop_chord(stack, workers, n)
                runs.noop_t.append(elapsed)
                runs.noop_u.append(usage)
        pipeline(stack, 10, p)  # warm-up, not counted
        for _ in range(args.runs):
            elapsed, report, usage, seen = pipeline(stack, n, p)
            runs.pipe_t.append(elapsed)
            runs.pipe_u.append(usage)
            runs.evidence.append(seen)
            runs.latency.append(
                report["reported_at"]
                - report["run_created_at"]
                - report["batch_to_all_rewards_seconds"]
            )


def off_the_stack(args: argparse.Namespace, runs: Runs) -> None:
    """The local backend alone, then a bare process pool."""
    n, p = args.episodes, args.parallelism
    for _ in range(args.runs):
        elapsed, usage, seen = backend_alone(n, p)
        runs.alone_t.append(elapsed)
        runs.alone_u.append(usage)
        runs.evidence.append(seen)
    for _ in range(args.runs):
        elapsed, cpu = bare_pool(n, p)
        runs.bare_t.append(elapsed)
        runs.bare_cpu.append(cpu)


def role_cpu(usages: list[Usage], role: str) -> Stats:
    return Stats([getattr(u, role) for u in usages])


def print_orchestration(n: int, runs: Runs) -> None:
    noop_t, noop_u, pipe_t, pipe_u = runs.noop_t, runs.noop_u, runs.pipe_t, runs.pipe_u
    alone_t, alone_u = runs.alone_t, runs.alone_u
    print(f"\n1. orchestration, N={n}{'':<33} {'total s':>24}   {'per item':>24}")
    print(" wall clock")
    line("no-op Celery chord of N tasks", Stats(noop_t), n, "ms/task")
    line("local backend alone (no Celery)", Stats(alone_t), n, "ms/episode")
    line("our pipeline, submit -> report", Stats(pipe_t), n, "ms/episode")
    gap = (Stats(pipe_t).median - Stats(alone_t).median) / n
    print(
        f"  pipeline - backend alone (medians): {gap * 1000:.2f} ms/episode "
        f"= {gap / (Stats(noop_t).median / n):.2f}x a no-op chord task"
    )
    print(
        f"  report latency (last reward -> report published): {Stats(runs.latency).fmt(digits=3)} s"
    )
    print(" CPU seconds (user+system)")
    line("no-op chord: control worker + children", role_cpu(noop_u, "control"), n, "ms/task")
    line("no-op chord: collector workers", role_cpu(noop_u, "collectors"), n, "ms/task")
    line("no-op chord: all workers", role_cpu(noop_u, "ours"), n, "ms/task")
    line("no-op chord: redis-server", role_cpu(noop_u, "redis"), n, "ms/task")
    line("pipeline: control worker + children", role_cpu(pipe_u, "control"), n, "ms/episode")
    line("pipeline: collectors", role_cpu(pipe_u, "collectors"), n, "ms/episode")
    line("pipeline: local supervisors (own)", role_cpu(pipe_u, "supervisors"), n, "ms/episode")
    line("pipeline: sandboxes (bwrap + episodes)", role_cpu(pipe_u, "sandboxes"), n, "ms/episode")
    line("pipeline: all of ours", role_cpu(pipe_u, "ours"), n, "ms/episode")
    line("pipeline: redis-server", role_cpu(pipe_u, "redis"), n, "ms/episode")
    line("pipeline: trainer client (not in ours)", role_cpu(pipe_u, "trainer"), n, "ms/episode")
    line("backend alone: supervisor (own)", role_cpu(alone_u, "supervisors"), n, "ms/episode")
    line("backend alone: sandboxes", role_cpu(alone_u, "sandboxes"), n, "ms/episode")
    line("backend alone: in-process collector", role_cpu(alone_u, "trainer"), n, "ms/episode")


def print_sandbox_cost(n: int, p: int, runs: Runs) -> None:
    alone_t, bare_t, evidence = runs.alone_t, runs.bare_t, runs.evidence
    print(f"\n2. sandbox cost, N={n}, parallelism {p}")
    line("bare process pool (no isolation): wall", Stats(bare_t), n, "ms/episode")
    line("local backend (bwrap + supervisor): wall", Stats(alone_t), n, "ms/episode")
    line("bare process pool: CPU", Stats(runs.bare_cpu), n, "ms/episode")
    local_cpu = Stats([u.supervisors + u.sandboxes for u in runs.alone_u])
    line("local backend: CPU (supervisor + sandboxes)", local_cpu, n, "ms/episode")
    print(
        f"  ratio local/bare (medians): wall {Stats(alone_t).median / Stats(bare_t).median:.2f}x,"
        f" CPU {local_cpu.median / Stats(runs.bare_cpu).median:.2f}x"
    )
    print(
        f"  every one of the {len(evidence)} local runs (pipeline and backend alone) was seen in "
        f"bwrap: at least {min(len(e.bwrap_pids) for e in evidence)} bwrap processes and "
        f"{min(len(e.isolated_pids) for e in evidence)} episode processes per run in their own "
        "pid/user/net namespaces, uid 1000 inside (host uid "
        f"{sorted(set().union(*(e.host_uids for e in evidence)))})"
    )


def main() -> None:
    args = parse_args()
    n, p, runs = args.episodes, args.parallelism, args.runs
    become_subreaper()  # daemonized supervisors come back to us, to be counted
    print(
        f"machine: {os.cpu_count()} cpus, python {sys.version.split()[0]}; N={n} episodes, "
        f"parallelism {p}, {runs} runs per figure: median [min-max]"
    )
    print(
        f"workers: control prefork x{args.control_concurrency}, "
        f"{args.collectors} collectors threads x{args.collect_concurrency} "
        "(the no-op chord runs on workers of the same shape)"
    )
    measured = Runs()
    on_the_stack(args, measured)
    off_the_stack(args, measured)
    for seen in measured.evidence:
        seen.assert_bwrap()  # every local run really ran in bubblewrap sandboxes
    print_orchestration(n, measured)
    print_sandbox_cost(n, p, measured)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # Celery's result consumer of the no-op chord retries its (stopped) Redis for minutes at
    # interpreter exit, printing tracebacks: nothing is left to clean up here.
    os._exit(0)

"""Benchmarks, measured in one run on this machine (not tests; they print ratios).

1. Orchestration cost: a no-op Celery chord of N tasks vs our pipeline collecting N local
   episodes, with the local backend alone (no Celery) running the same N episodes as the floor.
2. Sandbox cost: our local backend vs a bare process pool running the same episodes.

    python -m benchmarks.bench_pipeline [--episodes 200] [--parallelism 10] [--pool-episodes 100]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from celery import chord

from benchmarks.proc import tree_cpu_seconds
from rollout_wire.request import parse_spec
from rollout_worker.backends.local import LocalBackend
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings
from rollout_worker.stack import LocalStack
from trainer_stub.client import RolloutClient


def noop_chord(stack: LocalStack, n: int) -> float:
    os.environ["ROLLOUT_REDIS_URL"] = stack.redis_url  # read by noop_app at import
    from benchmarks.noop_app import app, done, noop

    log = open(stack.dir / "worker-bench.log", "wb")  # noqa: SIM115 - owned by the child
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "benchmarks.noop_app",
            "worker",
            "-Q",
            "bench",
            "-P",
            "prefork",
            "-c",
            "2",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "WARNING",
        ],
        env=stack.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    app.control.ping(timeout=10)
    time.sleep(2)
    start = time.perf_counter()
    result = chord([noop.s(i).set(queue="bench") for i in range(n)])(done.s().set(queue="bench"))
    # Wait on the callback only: following parents would poll every header task.
    count = result.get(timeout=600, follow_parents=False)
    elapsed = time.perf_counter() - start
    worker.terminate()
    worker.wait(30)
    assert count == n
    return elapsed


def pipeline(stack: LocalStack, n: int, parallelism: int) -> tuple[float, dict, float]:
    client = RolloutClient(stack.redis_url)
    pids = [w.proc.pid for w in stack.workers]
    cpu0 = tree_cpu_seconds(pids)
    start = time.perf_counter()
    submission = client.submit(count=n, parallelism=parallelism)
    report = client.wait(submission.batch_id, timeout=900)
    elapsed = time.perf_counter() - start
    # Workers only: the episodes run under the (detached) supervisor, not in this tree.
    cpu = tree_cpu_seconds(pids) - cpu0
    assert report["ok"] and report["reward_sum"] == n, report["errors"][:3]
    client.close()
    return elapsed, report, cpu


def backend_alone(n: int, parallelism: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        backend = LocalBackend(Settings(local_root=Path(root)))
        spec = parse_spec({"count": n, "parallelism": parallelism}, max_episodes=n)
        start = time.perf_counter()
        handle = backend.start_run(spec, lambda _: None)
        for index in range(n):
            assert backend.wait_episode(handle, index, 600).phase == "Succeeded"
        elapsed = time.perf_counter() - start
        backend.delete_run(handle)
    return elapsed


def bare_pool(n: int, parallelism: int) -> float:
    """The same episode program as plain subprocesses: no sandbox, no supervisor, no limits."""
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
            return subprocess.run(
                ["/usr/bin/python3", "-B", str(program)], env=env, capture_output=True, check=False
            ).returncode

        start = time.perf_counter()
        with ThreadPoolExecutor(parallelism) as pool:
            codes = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - start
    assert codes == [0] * n
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--parallelism", type=int, default=10)
    parser.add_argument("--pool-episodes", type=int, default=100)
    args = parser.parse_args()
    n, p = args.episodes, args.parallelism
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    print(f"machine: {os.cpu_count()} cpus, python {sys.version.split()[0]}")
    with LocalStack(collectors=2, extra_env=env) as stack:
        time.sleep(2)  # let workers finish booting so start-up is not measured
        t_noop = noop_chord(stack, n)
        t_pipe, report, cpu = pipeline(stack, n, p)
    t_alone = backend_alone(n, p)
    latency = (
        report["reported_at"] - report["run_created_at"] - report["batch_to_all_rewards_seconds"]
    )
    overhead = (t_pipe - t_alone) / n
    print(f"\n1. orchestration, N={n} episodes, parallelism {p}")
    row("no-op Celery chord of N tasks", t_noop, n, "task")
    row("local backend alone (no Celery)", t_alone, n, "episode")
    row("our pipeline, submit -> report", t_pipe, n, "episode")
    print(
        f"  pipeline overhead over the backend: {overhead * 1000:.2f} ms/episode "
        f"= {overhead / (t_noop / n):.2f}x a no-op chord task"
    )
    print(f"  report latency (last reward -> report published): {latency:.3f} s")
    print(f"  worker CPU (control + collectors): {cpu:.2f} s = {cpu / n * 1000:.1f} ms/episode")

    m = args.pool_episodes
    t_bare = bare_pool(m, p)
    t_local = backend_alone(m, p)
    print(f"\n2. sandbox cost, {m} episodes, parallelism {p}")
    row("bare process pool (no isolation)", t_bare, m, "episode")
    row("local backend (bwrap + supervisor)", t_local, m, "episode")
    print(f"  ratio local/bare: {t_local / t_bare:.2f}x")


def row(label: str, seconds: float, n: int, unit: str) -> None:
    print(f"  {label:<36} {seconds:8.2f} s  ({seconds / n * 1000:.2f} ms/{unit})")


if __name__ == "__main__":
    main()

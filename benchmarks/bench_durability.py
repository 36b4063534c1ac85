"""What Redis durability costs a batch: `appendfsync always` (fsync before every reply)
against `everysec` (fsync once a second; what compose and the chart run), both with an
append-only file, on the same stack shape and batch.

Each run starts a fresh all-in-one stack (redis-server with the policy, one control worker,
two collectors), submits one local-backend batch of --episodes episodes at --parallelism, and
times submit -> report as the trainer sees it. The policies alternate run by run; the figure
is the median of --runs runs of each [min-max], and the ratio always/everysec is taken pair by
pair. Redis's own CPU and its fsync count (INFO persistence: aof_delayed_fsync, and the AOF
size) are printed beside.

    python -m benchmarks.bench_durability [--episodes 1000] [--parallelism 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from rollout_worker.cli.stack import LocalStack
from trainer_stub.client import RolloutClient

POLICIES = ("everysec", "always")


def redis_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(policy: str, episodes: int, parallelism: int) -> dict[str, float]:
    env = {"ROLLOUT_MAX_BATCH_EPISODES": str(episodes)}
    with LocalStack(collectors=2, aof=True, appendfsync=policy, extra_env=env) as stack:
        stack.wait_ready()
        client = RolloutClient(stack.redis_url)
        assert client.redis.config_get("appendfsync")["appendfsync"] == policy
        assert stack.redis_proc is not None
        cpu_before = redis_cpu_seconds(stack.redis_proc.pid)
        started = time.monotonic()
        report = client.submit(count=episodes, parallelism=parallelism).wait(1800)
        wall = time.monotonic() - started
        cpu = redis_cpu_seconds(stack.redis_proc.pid) - cpu_before
        info = client.redis.info("persistence")
        client.close()
    if (report["collected_episodes"], report["successful_episodes"]) != (episodes, episodes):
        raise SystemExit(f"{policy}: the batch did not succeed whole: {report['errors'][:3]}")
    return {
        "wall": wall,
        "redis_cpu": cpu,
        "aof_mb": info.get("aof_current_size", 0) / 2**20,
        "delayed_fsync": float(info.get("aof_delayed_fsync", 0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--parallelism", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for run in range(args.runs):
        for policy in POLICIES:
            figures = one_run(policy, args.episodes, args.parallelism)
            results[policy].append(figures)
            shown = " ".join(f"{k}={v:.2f}" for k, v in figures.items())
            print(f"run {run + 1} {policy:8} {shown}", flush=True)

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    print(f"\n{args.episodes} episodes, parallelism {args.parallelism}, {args.runs} runs each")
    print(f"{'figure':14} {'everysec':>22} {'always':>22}")
    for name in ("wall", "redis_cpu", "aof_mb"):
        columns = [cell([r[name] for r in results[p]]) for p in POLICIES]
        print(f"{name:14} {columns[0]:>22} {columns[1]:>22}")
    ratios = [a["wall"] / e["wall"] for e, a in zip(*results.values(), strict=True)]
    print(f"wall always/everysec, pair by pair: {cell(ratios)}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

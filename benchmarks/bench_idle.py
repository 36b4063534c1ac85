"""What the workers cost while no batch runs: CPU per second of an idle stack of the shape
bench_kubernetes uses (control prefork x2, two collectors of 64 threads, Redis beside them).

A long batch's CPU per episode includes this fleet cost for its whole wall time, shared by its
episodes: subtract it to compare collection cost across episode lengths.

    python -m benchmarks.bench_idle [--seconds 60] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.harness import redis_pid, worker_roles
from benchmarks.proc import Meter
from rollout_worker.cli.stack import LocalStack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--collect-concurrency", type=int, default=64)
    args = parser.parse_args()
    assert args.runs >= 3, "a figure is a median of at least 3 runs"
    with LocalStack(collect_concurrency=args.collect_concurrency) as stack:
        stack.wait_ready()
        time.sleep(5)  # start-up done
        roles = worker_roles(stack)
        ours, redis = [], []
        for _ in range(args.runs):
            meter = Meter(roles, redis_pid(stack), str(stack.dir), reap_orphans=False).start()
            time.sleep(args.seconds)
            usage, _ = meter.stop()
            ours.append(usage.ours / args.seconds * 1000)
            redis.append(usage.redis / args.seconds * 1000)
    print(
        f"idle workers: {statistics.median(ours):.2f} ms CPU per second "
        f"[{min(ours):.2f}-{max(ours):.2f}], redis {statistics.median(redis):.2f} "
        f"[{min(redis):.2f}-{max(redis):.2f}] ({args.runs} runs of {args.seconds:g} s)"
    )


if __name__ == "__main__":
    main()

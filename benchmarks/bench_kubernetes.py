"""The kubernetes backend on KWOK nodes: report latency and worker CPU per episode.

Each figure is the median of --runs runs [min-max]. CPU is that of every process of ours that
works for the batch (the control worker and its prefork children, the collectors; see proc.py),
with Redis beside it. The KWOK harness that plays the kubelet (it runs in this process and its
subprocesses) is not ours and is not counted.

Needs the local cluster (hack/localkube/cluster.sh up; eval "$(hack/localkube/cluster.sh env)").
Pods on KWOK nodes are simulated; their logs are served by tests.integration.kwok_episodes.

    python -m benchmarks.bench_kubernetes [--sizes 10 1000] [--parallelism 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from benchmarks.proc import Meter, Stats, Usage
from rollout_worker.stack import LocalStack
from tests.integration.kwok_episodes import SimulatedEpisodes
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

RUNTIME = "rollout-kwok"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--parallelism", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    assert args.runs >= 3, "a figure is a median of at least 3 runs"
    cluster = kc.ensure_cluster()
    kc.ensure_kwok_nodes(cluster, 4)
    try:
        client.NodeV1Api(cluster.api_client).create_runtime_class(
            {"metadata": {"name": RUNTIME}, "handler": "kwok"}
        )
    except ApiException as exc:
        if exc.status != 409:
            raise
    placement = kc.kwok_placement()
    env = {"KUBECONFIG": str(cluster.kubeconfig)}
    with (
        tempfile.TemporaryDirectory() as logs,
        SimulatedEpisodes(cluster, Path(logs)),
        LocalStack(collectors=2, collect_concurrency=16, extra_env=env) as stack,
    ):
        stack.wait_ready()
        rollout = RolloutClient(stack.redis_url)
        roles = {
            "control": [w.proc.pid for w in stack.workers if w.queue == "control"],
            "collectors": [w.proc.pid for w in stack.workers if w.queue == "collect"],
        }
        redis_pid = stack.redis_proc.pid if stack.redis_proc else None
        print(f"{args.runs} runs per size, median [min-max]; CPU in ms per episode")
        print(
            f"{'episodes':>8} {'wall s':>22} {'last done->report s':>22} "
            f"{'ours (control+collect)':>24} {'control':>22} {'collectors':>22} "
            f"{'redis-server':>22}  ok"
        )
        for size in args.sizes:
            walls, latencies, usages, oks = [], [], [], []
            for _ in range(args.runs):
                meter = Meter(roles, redis_pid, str(stack.dir), reap_orphans=False).start()
                start = time.perf_counter()
                submission = rollout.submit(
                    count=size,
                    parallelism=min(size, args.parallelism),
                    backend="kubernetes",
                    runtime=RUNTIME,
                    node_selector=placement["nodeSelector"],
                    tolerations=placement["tolerations"],
                )
                report = rollout.wait(submission.batch_id, timeout=1800)
                walls.append(time.perf_counter() - start)
                usage, _ = meter.stop()
                usages.append(usage)
                # The last Pod's finish (1 s resolution) is the start of the report latency.
                last_done = max(
                    max(row["reward_at"] or 0, row["finished_at"] or 0) for row in report["pods"]
                )
                latencies.append(report["reported_at"] - last_done)
                oks.append(f"{report['ok']} ({report['reward_sum']}/{size})")

            def per_episode(role: str, usages: list[Usage] = usages, size: int = size) -> str:
                return Stats([getattr(u, role) / size * 1000 for u in usages]).fmt(digits=1)

            print(
                f"{size:>8} {Stats(walls).fmt():>22} {Stats(latencies).fmt(digits=3):>22} "
                f"{per_episode('ours'):>24} {per_episode('control'):>22} "
                f"{per_episode('collectors'):>22} {per_episode('redis'):>22}  {', '.join(oks)}"
            )
        rollout.close()


if __name__ == "__main__":
    main()

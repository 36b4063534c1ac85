"""The kubernetes backend on KWOK nodes: report latency and worker CPU per episode.

Needs the local cluster (hack/localkube/cluster.sh up; eval "$(hack/localkube/cluster.sh env)").
Pods on KWOK nodes are simulated; their logs are served by tests.integration.kwok_episodes.

    python -m benchmarks.bench_kubernetes [--sizes 10 1000] [--parallelism 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from benchmarks.proc import tree_cpu_seconds
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
    args = parser.parse_args()
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
        rollout = RolloutClient(stack.redis_url)
        time.sleep(3)  # workers booted
        pids = [w.proc.pid for w in stack.workers]
        print(
            f"{'episodes':>9} {'wall s':>8} {'last done->report s':>22} "
            f"{'worker CPU s':>13} {'CPU ms/episode':>15}  ok"
        )
        for size in args.sizes:
            cpu0 = tree_cpu_seconds(pids)
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
            wall = time.perf_counter() - start
            cpu = tree_cpu_seconds(pids) - cpu0
            # On KWOK the simulated reward event is written when the Pod appears, so the last
            # Pod's finish (1 s resolution) is the fairer start of the report latency there.
            last_done = max(
                max(row["reward_at"] or 0, row["finished_at"] or 0) for row in report["pods"]
            )
            latency = report["reported_at"] - last_done
            print(
                f"{size:>9} {wall:>8.2f} {latency:>22.3f} {cpu:>13.2f} "
                f"{cpu / size * 1000:>15.1f}  {report['ok']} ({report['reward_sum']}/{size})"
            )
        rollout.close()


if __name__ == "__main__":
    main()

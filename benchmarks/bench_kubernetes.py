"""The kubernetes backend on KWOK nodes: report latency and worker CPU per episode.

Needs the local cluster (hack/localkube/cluster.sh up; eval "$(hack/localkube/cluster.sh env)").
Pods on KWOK nodes are simulated; their logs are served by tests.integration.kwok_episodes.

    python -m benchmarks.bench_kubernetes [--sizes 10 1000] [--parallelism 200]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kubernetes import client
from kubernetes.client.rest import ApiException

from rollout_worker.stack import LocalStack
from tests.integration.kwok_episodes import SimulatedEpisodes
from tests.k8s import cluster as kc
from trainer_stub.client import RolloutClient

RUNTIME = "rollout-kwok"
TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root_pids: list[int]) -> float:
    """user+system CPU of these processes and all their descendants (and reaped children)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(v) for v in fields[11:15]) / TICK
    total, todo, seen = 0.0, list(root_pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += times.get(pid, 0.0)
        todo += [child for child, parent in parents.items() if parent == pid]
    return total


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

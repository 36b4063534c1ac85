"""What one Pod costs the real node itself, apart from anything a scheduler decides.

A batch of bare Pods (the episode image running `true`, an episode's security context, in a
namespace whose deny-all NetworkPolicy makes the node's CNI program rules for each, as a batch's
does) is created at once on the real node, run to the end and deleted with its namespace. The
machine's busy CPU-seconds over that (from /proc/stat, less the idle machine's rate measured
just before), less what the Pods' own cgroups used, over the number of Pods, is the node's work
per Pod: the kubelet, containerd, the shims and runc, the CNI plugins, the API server and etcd.

The rounds vary (other work in a window only adds), so a bound uses the lowest round. Since
the real node shares this machine's cores with everything else, a batch of N episodes on
it cannot end sooner than (N x that + the episodes' own CPU) / the cores left over from the idle
machine, whatever keeps its slots busy: `bench_slots` prints that bound beside its goals.

    python -m benchmarks.pod_floor [--pods 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from benchmarks.harness import require_rounds
from benchmarks.proc import TICK, machine_busy_seconds, settle
from tests.k8s import cluster as kc


def pods_cgroup() -> str:
    """The kubelet's Pods cgroup (cgroup v1): under /rollout-node-N for node N > 0, as
    hack/localkube/node.sh sets its cgroupRoot (hack/with-caches.sh runs node 1)."""
    node = int(os.environ.get("ROLLOUT_LOCALKUBE_NODE_ID") or 0)
    root = "" if node == 0 else f"/rollout-node-{node}"
    return f"/sys/fs/cgroup/cpuacct{root}/kubepods/cpuacct.usage"


DAEMONS = ("kubelet", "containerd", "kube-apiserver", "etcd")
LABEL = {"rollout.dev/probe": "pod-floor"}


@dataclass(frozen=True)
class Floor:
    per_pod: float  # node CPU-seconds per Pod, outside the Pods' own cgroups
    pods_own: float  # the Pods' own CPU-seconds per Pod (`true` and the pause container)
    idle_cores: float  # the idle machine's busy cores (control plane, kubelet housekeeping)
    daemons: dict[str, float]  # CPU-seconds per Pod of each long-lived daemon (and its reaped)


def pods_cgroup_seconds() -> float:
    with open(pods_cgroup()) as handle:
        return int(handle.read()) / 1e9


def daemon_seconds() -> dict[str, float]:
    """Each daemon's own CPU plus its reaped children's (containerd reaps the CNI plugins)."""
    totals = dict.fromkeys(DAEMONS, 0.0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm in totals:
            fields = stat[stat.rindex(")") + 2 :].split()
            totals[comm] += sum(int(v) for v in fields[11:15]) / TICK
    return totals


def pod_manifest(node: kc.RealNode, index: int) -> dict[str, Any]:
    no_privilege = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return {
        "metadata": {"name": f"bare-{index}", "labels": LABEL},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "runtimeClassName": node.runtime_class,
            **node.placement(),
            "securityContext": {"runAsUser": 1000, "runAsNonRoot": True},
            "containers": [
                {
                    "name": "bare",
                    "image": node.image,
                    "imagePullPolicy": node.image_pull_policy,
                    "command": ["true"],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                    "securityContext": no_privilege,
                }
            ],
        },
    }


def measure(cluster: kc.Cluster, node: kc.RealNode, pods: int) -> Floor:
    settle()
    start, idle_start = time.monotonic(), machine_busy_seconds()
    time.sleep(10)
    idle_cores = (machine_busy_seconds() - idle_start) / (time.monotonic() - start)
    name = kc.unique_namespace_name("pod-floor")
    core = cluster.core
    start, busy, own, daemons = (
        time.monotonic(),
        machine_busy_seconds(),
        pods_cgroup_seconds(),
        daemon_seconds(),
    )
    core.create_namespace({"metadata": {"name": name, "labels": LABEL}})
    deny = {
        "metadata": {"name": "deny-all", "labels": LABEL},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
    }
    client.NetworkingV1Api(cluster.api_client).create_namespaced_network_policy(name, deny)
    for index in range(pods):
        core.create_namespaced_pod(name, pod_manifest(node, index))

    def ended() -> bool:
        found = core.list_namespaced_pod(name).items
        return sum(p.status.phase in ("Succeeded", "Failed") for p in found) == pods

    kc.wait_for(ended, timeout=120 + 5 * pods, what=f"{pods} bare Pods to end")
    core.delete_namespace(name)

    def gone() -> bool:
        try:
            core.read_namespace(name)
        except ApiException as exc:
            return exc.status == 404
        return False

    kc.wait_for(gone, timeout=300, what=f"namespace {name} to go")
    settle()  # the node's teardown runs on after the API objects are gone
    wall = time.monotonic() - start
    node_work = machine_busy_seconds() - busy - idle_cores * wall
    pods_own = pods_cgroup_seconds() - own
    after = daemon_seconds()
    return Floor(
        per_pod=(node_work - pods_own) / pods,
        pods_own=pods_own / pods,
        idle_cores=idle_cores,
        daemons={d: (after[d] - daemons[d]) / pods for d in DAEMONS},
    )


def lowest(floors: list[Floor]) -> Floor:
    """The round with the least node work per Pod: anything else the machine did in a window
    (a previous batch's teardown, containerd's own housekeeping) can only add to it, so this is
    the one a lower bound may use."""
    return min(floors, key=lambda f: f.per_pod)


def median_floor(floors: list[Floor]) -> Floor:
    return Floor(
        per_pod=statistics.median(f.per_pod for f in floors),
        pods_own=statistics.median(f.pods_own for f in floors),
        idle_cores=statistics.median(f.idle_cores for f in floors),
        daemons={d: statistics.median(f.daemons[d] for f in floors) for d in DAEMONS},
    )


def describe(floor: Floor) -> str:
    parts = ", ".join(f"{d} {v:.3f}" for d, v in floor.daemons.items())
    return (
        f"node work per Pod {floor.per_pod:.3f} CPU-s (of it: {parts}; the rest: shims, runc,"
        f" the CNI plugins' own processes), the Pods' own {floor.pods_own:.3f}; idle machine"
        f" {floor.idle_cores:.2f} cores busy"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_rounds(parser, args.rounds)
    cluster = kc.ensure_cluster()
    node = kc.ensure_real_node(cluster)
    floors = []
    for number in range(args.rounds):
        floors.append(measure(cluster, node, args.pods))
        print(f"round {number + 1}: {describe(floors[-1])}", flush=True)
    print(f"\n{args.pods} bare Pods on {node.name}, {args.rounds} rounds, medians:")
    print(f"  {describe(median_floor(floors))}")
    print(f"lowest round (what a lower bound uses):\n  {describe(lowest(floors))}")
    print(f"  load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

"""How fast this cluster's Job controller creates Pods, with nothing of ours running: the figure
behind ROLLOUT_POD_CREATE_RATE.

One Indexed Job of --count Pods at --parallelism on KWOK nodes; its Pods end as soon as they run
(the local cluster's KWOK stage ends Job Pods that are not batch Pods at once), so only the
controller's Pod creation (and what it costs the API server on this machine) limits the Job.
Printed: Pods created per second (the benchmark's watch, from the first Pod to the last, and
the median of 10 s windows), Job created -> Complete, and kube-controller-manager's own client
figures from its /metrics: requests made, and how long its client rate limiter made them wait
(`rest_client_rate_limiter_duration_seconds`; near zero means the limiter was not the limit).

Needs a cluster (hack/localkube/cluster.sh up; eval "$(hack/localkube/cluster.sh env)").
`ROLLOUT_LOCALKUBE_KCM_QPS=20 ROLLOUT_LOCALKUBE_KCM_BURST=30` on `cluster.sh up` gives a stock
controller manager.

    python -m benchmarks.bench_job_create [--count 5000] [--parallelism 500] [--runs 1]
"""

from __future__ import annotations

import re
import ssl
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from benchmarks.harness import new_parser
from tests.k8s import cluster as kc

_SAMPLE = re.compile(r"^(rest_client_[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$")


def _server(kubeconfig: Path) -> str | None:
    try:
        match = re.search(r"server:\s*(\S+)", kubeconfig.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def kcm_port(kubeconfig: Path) -> int:
    """The secure port of the kube-controller-manager of this kubeconfig's cluster (the one
    whose own kubeconfig names the same API server)."""
    server = _server(kubeconfig)
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "kube-controller-manager" not in line:
            continue
        port = re.search(r"--secure-port=(\d+)", line)
        own = re.search(r"--kubeconfig=(\S+)", line)
        if port and own and _server(Path(own.group(1))) == server:
            return int(port.group(1))
    raise RuntimeError(f"no kube-controller-manager found for the API server {server}")


def kcm_client_metrics(port: int) -> dict[str, float]:
    """Sums of the controller manager's client request and rate-limiter metrics."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=30) as r:
        text = r.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        key = name
        if name == "rest_client_requests_total":
            method = re.search(r'method="(\w+)"', labels)
            key = f"{name} {method.group(1) if method else '?'}"
        if name.endswith(("_sum", "_count")) or name == "rest_client_requests_total":
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


class Created(threading.Thread):
    """When the benchmark's watch first saw each Pod of the namespace (ADDED)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, count: int) -> None:
        super().__init__(daemon=True)
        self.core, self.namespace, self.count = core, namespace, count
        self.seen: dict[str, float] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        version = None
        while not self.halt.is_set() and len(self.seen) < self.count:
            stream = watch.Watch()
            kwargs: dict[str, Any] = {"timeout_seconds": 30, "deserialize": False}
            if version:
                kwargs["resource_version"] = version
            try:
                for event in stream.stream(self.core.list_namespaced_pod, self.namespace, **kwargs):
                    meta = (event.get("object") or {}).get("metadata") or {}
                    if event.get("type") == "ERROR":
                        version = None
                        break
                    version = meta.get("resourceVersion", version)
                    self.seen.setdefault(meta.get("name", ""), time.time())
                    if self.halt.is_set() or len(self.seen) >= self.count:
                        break
            except Exception:
                version = None
                time.sleep(0.2)
            finally:
                stream.stop()


def one_run(cluster: kc.Cluster, port: int, count: int, parallelism: int, timeout: float) -> dict:
    core, batch = cluster.core, client.BatchV1Api(cluster.api_client)
    namespace = kc.unique_namespace_name("jobrate")
    core.create_namespace({"metadata": {"name": namespace}})
    created = Created(core, namespace, count)
    created.start()
    before = kcm_client_metrics(port)
    job = {
        "metadata": {"name": "probe"},
        "spec": {
            "completions": count,
            "parallelism": parallelism,
            "completionMode": "Indexed",
            "backoffLimitPerIndex": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "probe:1"}],
                    **kc.kwok_placement(),
                }
            },
        },
    }
    start = time.time()
    batch.create_namespaced_job(namespace, job)
    complete_at = None
    while time.time() - start < timeout:
        status = batch.read_namespaced_job_status("probe", namespace).status
        conditions = {c.type: c.status for c in status.conditions or []}
        if conditions.get("Complete") == "True" or conditions.get("Failed") == "True":
            complete_at = time.time()
            break
        time.sleep(0.5)
    after = kcm_client_metrics(port)
    created.halt.set()
    created.join(35)
    core.delete_namespace(namespace)
    times = sorted(created.seen.values())
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    windows = []
    t = times[0] if times else start
    while times and t + 10 <= times[-1]:
        windows.append(sum(1 for x in times if t <= x < t + 10) / 10)
        t += 10
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    waited = delta.get("rest_client_rate_limiter_duration_seconds_sum", 0.0)
    waits = delta.get("rest_client_rate_limiter_duration_seconds_count", 0.0)
    requests = sum(v for k, v in delta.items() if k.startswith("rest_client_requests_total "))
    duration = (complete_at or time.time()) - start
    return {
        "count": count,
        "parallelism": parallelism,
        "pods_seen": len(times),
        "complete": complete_at is not None,
        "job_seconds": duration,
        "rate_overall": (len(times) - 1) / span if span == span and span > 0 else float("nan"),
        "rate_window_median": statistics.median(windows) if windows else float("nan"),
        "rate_window_max": max(windows) if windows else float("nan"),
        "first_pod_after": (times[0] - start) if times else float("nan"),
        "kcm_requests": requests,
        "kcm_requests_per_s": requests / duration,
        "kcm_by_method": {
            k.split()[-1]: int(v) for k, v in delta.items() if k.startswith("rest_client_requests")
        },
        "kcm_limiter_wait_s": waited,
        "kcm_limiter_wait_ms_per_request": waited / waits * 1000 if waits else float("nan"),
    }


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--parallelism", type=int, default=500)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    cluster = kc.ensure_cluster()
    kc.ensure_kwok_nodes(cluster, 4)
    port = kcm_port(Path(cluster.kubeconfig))
    flags = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    qps = sorted(set(re.findall(r"--kube-api-(?:qps|burst)=\S+", flags)))
    print(f"cluster {cluster.kubeconfig}; controller-manager flags seen on this machine: {qps}")
    for _ in range(args.runs):
        r = one_run(cluster, port, args.count, args.parallelism, args.timeout)
        print(
            f"  {r['count']} Pods at parallelism {r['parallelism']}: complete={r['complete']} "
            f"in {r['job_seconds']:.1f} s; Pods created {r['rate_overall']:.1f}/s overall, "
            f"10 s windows median {r['rate_window_median']:.1f}/s (max "
            f"{r['rate_window_max']:.1f}); controller-manager {r['kcm_requests']:.0f} requests "
            f"({r['kcm_requests_per_s']:.1f}/s: {r['kcm_by_method']}), its rate limiter "
            f"made them wait {r['kcm_limiter_wait_s']:.1f} s in all "
            f"({r['kcm_limiter_wait_ms_per_request']:.2f} ms per request)",
            flush=True,
        )


if __name__ == "__main__":
    main()

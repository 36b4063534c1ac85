"""Measuring aids for bench_kubernetes: a timed KWOK harness, a terminal-Pod watch, the API
server's request counters and a memory sampler.

- `TimedEpisodes` is the KWOK harness (tests.integration.kwok_episodes) serving a batch by a
  seeded mix of only `success` fates, with an optional episode length: the Pod is annotated (and
  so ended by the KWOK stage, 1-2.5 s later) `seconds` after the harness took it. It records
  when it annotated each Pod and counts its own Pod reads (one GET per claim), which the API
  figures leave out.
- `TerminalWatch` is the benchmark's own watch of one batch namespace: the time it first saw
  each episode's Pod Succeeded or Failed is when that episode was terminal in the API.
- `api_reads()` scrapes `apiserver_request_total` from the API server's /metrics.
- `MemorySampler` follows the resident memory of the workers and Redis's used_memory.
- `ClusterMeter` says where a run's wall went outside our workers: the CPU of each local
  control-plane process (etcd, API server, controllers, KWOK), the machine's busy, steal and
  iowait seconds, CPU and I/O pressure stall seconds, and etcd's fsyncs and their total time.
"""

from __future__ import annotations

import contextlib
import functools
import re
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from kubernetes import client, config

from benchmarks.proc import TICK, descendants, snapshot
from rollout_worker.backends.kube.watch import RawWatch
from tests.integration.kwok_episodes import INDEX_LABEL, SUCCESS, KwokEpisodes, Mix
from tests.k8s import cluster as kc

ALL_SUCCESS = ((SUCCESS, 1),)
READ_VERBS = ("GET", "LIST", "WATCH")
RESOURCES = ("pods", "jobs", "namespaces")
PAGE = 4096


class TimedEpisodes(KwokEpisodes):
    def __init__(self, cluster: kc.Cluster, directory: Path) -> None:
        super().__init__(cluster, directory, api_workers=32)
        self._seconds: dict[str, float] = {}  # namespace -> episode length
        self.annotated: dict[str, dict[str, float]] = {}  # namespace -> pod -> time
        # Its own reads of Pods, left out of ours: a GET per claim, a cluster-wide watch.
        self.pod_gets = 0
        self.pod_watches = 0
        self.core.read_namespaced_pod = self._counted(self.core.read_namespaced_pod, "pod_gets")
        self.core.list_pod_for_all_namespaces = self._counted(
            self.core.list_pod_for_all_namespaces, "pod_watches"
        )

    def _counted(self, fn: Any, attr: str) -> Any:
        @functools.wraps(fn)  # kubernetes.watch reads the return type from the docstring
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                setattr(self, attr, getattr(self, attr) + 1)
            return fn(*args, **kwargs)

        return counted

    def serve(self, batch_id: str, seconds: float, seed: int = 0) -> None:
        namespace = f"rollout-{batch_id}"
        with self._lock:
            self._seconds[namespace] = seconds
            self.annotated[namespace] = {}
        self.use_mix(batch_id, Mix(seed, ALL_SUCCESS))

    def _finish(self, namespace: str, name: str, *rest: Any) -> None:
        seconds = self._seconds.get(namespace, 0.0)
        if seconds <= 0:
            self._finish_now(namespace, name, *rest)
            return
        timer = threading.Timer(seconds, self._finish_now, (namespace, name, *rest))
        timer.daemon = True
        timer.start()

    def _finish_now(self, namespace: str, name: str, *rest: Any) -> None:
        try:
            super()._finish(namespace, name, *rest)
            with self._lock:
                self.annotated.setdefault(namespace, {})[name] = time.time()
        except Exception as exc:  # recorded, as the harness records its own errors
            self.errors.append(f"{namespace}/{name}: finish: {type(exc).__name__}: {exc}")


class TerminalWatch(threading.Thread):
    """When each Pod of a batch namespace was first seen Succeeded or Failed (by index)."""

    def __init__(self, cluster: kc.Cluster, namespace: str, count: int) -> None:
        super().__init__(daemon=True, name=f"terminal-{namespace}")
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.namespace = namespace
        self.count = count
        self.terminal: dict[int, float] = {}
        self.seen: dict[int, float] = {}  # when each index's Pod was first seen (created)
        self.requests = 0  # namespace-scoped LIST/WATCH requests of this watch
        self._halt = threading.Event()

    def run(self) -> None:
        version: str | None = None
        while not self._halt.is_set() and len(self.terminal) < self.count:
            stream = RawWatch()  # events stay dicts; an expired version raises ApiException
            kwargs: dict[str, Any] = {"timeout_seconds": 30}
            if version:
                kwargs["resource_version"] = version
            self.requests += 1
            try:
                for event in stream.stream(self.core.list_namespaced_pod, self.namespace, **kwargs):
                    now = time.time()
                    pod = event.get("object") or {}
                    meta = pod.get("metadata") or {}
                    version = meta.get("resourceVersion", version)
                    phase = (pod.get("status") or {}).get("phase")
                    index = (meta.get("labels") or {}).get(INDEX_LABEL)
                    if index is not None:
                        self.seen.setdefault(int(index), now)
                    if phase in ("Succeeded", "Failed") and index is not None:
                        self.terminal.setdefault(int(index), now)
                    if self._halt.is_set() or len(self.terminal) >= self.count:
                        break
            except Exception:  # resume from a fresh list
                version = None
                time.sleep(0.2)
            finally:
                stream.stop()

    def stop(self) -> None:
        self._halt.set()
        self.join(35)
        self.api.close()


_SAMPLE = re.compile(r"^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$")


def api_reads() -> Counter[str]:
    """Our kind of reads so far, by "VERB resource[/sub] scope": GET/LIST/WATCH of pods, jobs
    and namespaces, and pod log reads (CONNECT pods/log)."""
    text = subprocess.run(
        [str(kc.REPO_ROOT / "hack/localkube/cluster.sh"), "kubectl", "get", "--raw", "/metrics"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        resource, sub, verb = labels["resource"], labels["subresource"], labels["verb"]
        if resource not in RESOURCES:
            continue
        if (verb in READ_VERBS and sub in ("", "log", "status")) or (
            resource == "pods" and sub == "log"
        ):
            key = f"{verb} {resource}{'/' + sub if sub else ''} {labels['scope']}"
            counts[key] += int(float(match.group(2)))
    return counts


class MemorySampler(threading.Thread):
    """Peak summed RSS of the workers (and their children) and peak Redis used_memory."""

    def __init__(self, roots: list[int], redis: Any, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.roots, self.redis, self.interval = roots, redis, interval
        self.rss_start = self.rss_peak = self._rss()
        self.redis_start = self.redis_peak = self._redis()
        self._halt = threading.Event()

    def _rss(self) -> int:
        total = 0
        for pid in descendants(snapshot(), self.roots):
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        return total

    def _redis(self) -> int:
        return int(self.redis.info("memory")["used_memory"])

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.rss_peak = max(self.rss_peak, self._rss())
            self.redis_peak = max(self.redis_peak, self._redis())

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.rss_peak = max(self.rss_peak, self._rss())
        self.redis_peak = max(self.redis_peak, self._redis())


# The local cluster's processes (hack/localkube), by the kernel's 15-character command name.
CLUSTER_PROCESSES = {
    "etcd": "etcd",
    "kube-apiserver": "apiserver",
    "kube-controller": "controllers",
    "kube-scheduler": "scheduler",
    "kwok-controller": "kwok",
}
_ETCD_METRICS = "http://127.0.0.1:32765/metrics"  # hack/localkube's etcd client URL
_ETCD_SAMPLES = (
    "etcd_disk_wal_fsync_duration_seconds_count",
    "etcd_disk_wal_fsync_duration_seconds_sum",
    "etcd_disk_backend_commit_duration_seconds_sum",
)


class ClusterMeter:
    """Where a run's time went outside the workers, from `start()` to `stop()`: CPU-seconds of
    each control-plane process, the machine's busy / steal / iowait seconds, pressure stall
    seconds (some task waiting for CPU, for I/O) and etcd's fsyncs. Read from /proc and etcd's
    /metrics, so it needs the local cluster on this machine."""

    def start(self) -> ClusterMeter:
        self._start = self._read()
        return self

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {key: round(end[key] - self._start.get(key, 0.0), 3) for key in end}

    def _read(self) -> dict[str, float]:
        values: dict[str, float] = dict.fromkeys(CLUSTER_PROCESSES.values(), 0.0)
        procs = snapshot()
        for proc in procs.values():
            name = CLUSTER_PROCESSES.get(proc.comm)
            if name is not None:
                values[name] += proc.own
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        values["machine_busy"] = (sum(cpu) - cpu[3] - cpu[4]) / TICK
        values["machine_iowait"], values["machine_steal"] = cpu[4] / TICK, cpu[7] / TICK
        for kind in ("cpu", "io"):
            text = Path(f"/proc/pressure/{kind}").read_text()
            values[f"pressure_{kind}"] = int(text.split("total=")[1].split()[0]) / 1e6
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(_ETCD_METRICS, timeout=5) as answer,
        ):
            for line in answer.read().decode().splitlines():
                name, _, number = line.partition(" ")
                if name in _ETCD_SAMPLES:
                    values[name.removeprefix("etcd_disk_")] = float(number)
        return values

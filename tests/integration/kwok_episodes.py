"""Simulated episodes for KWOK nodes, where no container ever runs.

For every batch Pod that appears, write the log the episode program would have printed (a
`ready` and a `reward` event naming the Pod) and serve it through a KWOK `Logs` object, so the
pipeline reads it through the API server exactly as it reads a real Pod's log.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from rollout_wire import constants as k
from tests.k8s import cluster as kc


def episode_lines(pod_name: str, reward: int = 1) -> list[str]:
    now = time.time()
    ready = {"event": "ready", "at": now, "episode_id": pod_name}
    done = {
        "event": "reward",
        "at": now + 0.001,
        "episode_id": pod_name,
        "reward": reward,
        "baseline_exit": 1,
        "tests_exit": 0 if reward else 1,
        "tests_output": "simulated",
    }
    return [json.dumps(ready), json.dumps(done)]


class SimulatedEpisodes:
    def __init__(self, cluster: kc.Cluster, directory: Path) -> None:
        self.cluster = cluster
        self.directory = directory
        self.seen: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kwok-episodes", daemon=True)
        # Pods arrive hundreds at a time; serve them in parallel, well before KWOK finishes them.
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="kwok-logs")

    def __enter__(self) -> SimulatedEpisodes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        core = client.CoreV1Api(self.cluster.api_client)
        selector = f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE}"
        while not self._stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                    core.list_pod_for_all_namespaces, label_selector=selector, timeout_seconds=2
                ):
                    pod = event["raw_object"]
                    key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
                    if event["type"] == "ADDED" and key not in self.seen:
                        self.seen.add(key)
                        self._pool.submit(
                            self._serve, pod["metadata"]["namespace"], pod["metadata"]["name"]
                        )
                    if self._stop.is_set():
                        break
            except (ApiException, OSError) as exc:
                self.errors.append(str(exc))
                time.sleep(0.2)
            finally:
                stream.stop()

    def _serve(self, namespace: str, name: str) -> None:
        key = f"{namespace}/{name}"
        path = kc.write_cri_log(self.directory / namespace / f"{name}.log", episode_lines(name))
        try:
            kc.create_pod_logs(self.cluster, namespace, name, path)
        except ApiException as exc:
            if exc.status != 409:
                self.errors.append(f"{key}: {exc.status} {exc.reason}")

"""The Kubernetes backend: one namespace and one Indexed Job per batch.

The API calls live here (warm pools' in `pools.py`, the shared Pod watch in `watch.py`, the
ownership-checked namespace delete in `namespaces.py`); the objects come from `objects.py` and
are read by `read.py` (both pure). Every API error is translated at this edge into our errors
(404 -> ResourceNotFound, 409 -> ResourceConflict, 429/5xx/connection ->
TransientBackendError). Responses are read as JSON dicts (no model deserialisation): faster
at 1000 Pods, and exactly what kubectl would save as records.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rollout_wire import constants as k
from rollout_wire.errors import (
    BackendError,
    BackendUnavailable,
    CapacityError,
    OwnershipError,
    ResourceConflict,
    ResourceNotFound,
    TransientBackendError,
)
from rollout_wire.request import BatchSpec
from rollout_worker.backends import warm
from rollout_worker.backends.base import (
    MAX_LOG_BYTES,
    Fed,
    FinishedRun,
    ReceiptUpdate,
    RunHandle,
)
from rollout_worker.backends.kube import objects, read
from rollout_worker.backends.kube.namespaces import delete_namespace
from rollout_worker.backends.kube.objects import (
    JOB_NAME,
    configmap_manifest,
    job_manifest,
    job_parts,
    namespace_manifest,
    namespace_name,
    network_policy_manifest,
)
from rollout_worker.backends.kube.pod_spec import CONTAINER_NAME, grades_apart
from rollout_worker.backends.kube.pools import Claimed, WarmPools
from rollout_worker.backends.kube.read import (
    RETRYING,
    capacity_plan,
    completion_index,
    events_text,
    index_in,
    job_of,
    job_verdict,
    jobs_verdict,
    node_ready,
    observe_pods,
    pretty_json,
    ts,
)
from rollout_worker.backends.kube.watch import PodWatch, PodWatches, RawWatch
from rollout_worker.observation import EpisodeObservation
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings

JOB_CACHE_SECONDS = 1.0
JOB_SETTLE_SECONDS = 25  # after the report; well under the visibility timeout
REQUEST_TIMEOUT = 30
# The feeder tops its pool up at most this often (each top-up lists the pool: the watch may
# not show the Pods the last one created yet).
FEED_FILL_EVERY_SECONDS = 1.0
# The pool a fed run keeps ahead of itself, in waves of its parallelism: a Pod takes longer to
# start than a short episode to run, so one wave ahead left slots idle (on the 2-core real
# node, 72 episodes at parallelism 10: 111 s with one wave ahead, 62 s with two, 61 s with
# three; benchmarks/bench_slots.py).
FEED_AHEAD_WAVES = 2
# A waker whose parked episodes run both in a pool and in the Job waits on the Job's watch this
# long at a time, looking at the pool's in between.
MIXED_WAIT_SECONDS = 1.0
# `wait_ended`'s caller, the batch's waker (one per batch and process): its watch remembers
# what it checked, so each call checks only what changed.
WAKER = "waker"


def _translate(exc: Exception, what: str) -> BackendError:
    if isinstance(exc, ApiException):
        try:
            message = orjson.loads(exc.body or b"{}").get("message") or exc.reason
        except orjson.JSONDecodeError:
            message = exc.reason
        text = f"{what}: {exc.status} {message}"
        if exc.status == 404:
            return ResourceNotFound(text)
        if exc.status == 409:
            return ResourceConflict(text)
        if exc.status in (429, 500, 502, 503, 504):
            return TransientBackendError(text)
        return BackendError(text)
    return TransientBackendError(f"{what}: {type(exc).__name__}: {exc}")


def _api_client(settings: Settings) -> tuple[client.ApiClient, str]:
    cfg = client.Configuration()
    kubeconfig = settings.kubeconfig or os.path.expanduser("~/.kube/config")
    try:
        if settings.kubeconfig or os.path.exists(kubeconfig):
            config.load_kube_config(
                config_file=kubeconfig,
                context=settings.kube_context,
                client_configuration=cfg,
                persist_config=False,
            )
            _contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            context = settings.kube_context or active["name"]
        else:
            config.load_incluster_config(client_configuration=cfg)
            context = "in-cluster"
    except (config.ConfigException, OSError, KeyError, TypeError) as exc:
        raise BackendUnavailable(f"no usable Kubernetes configuration: {exc}") from exc
    cfg.connection_pool_maxsize = 128  # collectors run many threads per process
    return client.ApiClient(cfg), context


def _ended(handle: RunHandle, index: int, pods: dict[str, dict[str, Any]]) -> bool:
    """What the watch shows of episode `index` is its end."""
    if handle.warm_pod(index) is not None and not pods:
        return True  # claimed before the run existed, so a synced watch has it: gone
    return observe_pods(handle, index, pods, final=handle.in_pool(index)).terminal


class KubernetesBackend:
    name = "kubernetes"
    streams_progress = False  # a Pod cannot reach Redis: collectors stream what they watch

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.api, self.context = _api_client(settings)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.nodes_api = client.NodeV1Api(self.api)
        self.net = client.NetworkingV1Api(self.api)
        self.watches = PodWatches()
        self.pools = WarmPools(
            self._call, self._text, self.core, self.net, settings.warm_handover_threads
        )
        self.program = episode_program_text()  # read once: pool keys, ConfigMaps
        self._jobs: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._jobs_lock = threading.Lock()

    # -- the edge: every call goes through here ----------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        try:
            response = fn(*args, _preload_content=False, **kwargs)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _translate(exc, what) from exc
        return orjson.loads(response.data) if response.data else {}

    def _text(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        try:
            response = fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _translate(exc, what) from exc
        return response.data.decode("utf-8", errors="replace")

    def check(self, runtime: str) -> tuple[list[str], list[str]]:
        """For `rollout check`: (what was found, what is missing) in the cluster."""
        found, missing = [], []
        version = self._call("version", client.VersionApi(self.api).get_code)
        found.append(f"cluster: {self.context} ({version.get('gitVersion')})")
        nodes = self._call("nodes", self.core.list_node)["items"]
        ready = [n["metadata"]["name"] for n in nodes if node_ready(n)]
        found.append(f"nodes: {len(ready)} ready of {len(nodes)}")
        if not ready:
            missing.append("no Ready node")
        try:
            rc = self._call(f"RuntimeClass {runtime}", self.nodes_api.read_runtime_class, runtime)
            overhead = (rc.get("overhead") or {}).get("podFixed") or {}
            found.append(
                f"RuntimeClass {runtime}: handler {rc.get('handler')}, "
                f"overhead {overhead or 'none'}"
            )
        except ResourceNotFound:
            missing.append(f"RuntimeClass {runtime!r} does not exist (use --runtime)")
        return found, missing

    # -- protocol ----------------------------------------------------------------------------
    def preflight(self, spec: BatchSpec) -> list[str]:
        try:
            runtime = self._call(
                f"RuntimeClass {spec.runtime}", self.nodes_api.read_runtime_class, spec.runtime
            )
        except ResourceNotFound as exc:
            names = [
                rc["metadata"]["name"]
                for rc in self._call("RuntimeClasses", self.nodes_api.list_runtime_class)["items"]
            ]
            raise BackendError(
                f"RuntimeClass {spec.runtime!r} does not exist in context "
                f"{self.context!r}; available: {names}"
            ) from exc
        if spec.capacity_check == "off":
            return []
        nodes = self._call("nodes", self.core.list_node)["items"]
        pods = self._call(
            "pods",
            self.core.list_pod_for_all_namespaces,
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
        )["items"]
        overhead = (runtime.get("overhead") or {}).get("podFixed") or {}
        fits, text = capacity_plan(spec, nodes, pods, overhead, runtime.get("scheduling") or {})
        key = self.pool_key(spec)
        if fits < spec.parallelism and key is not None:
            # Waiting Pods of this batch's pool hold room this batch takes over with them.
            warm = sum(1 for p in self.pools.pods(key) if read.pool_pod_waiting(p))
            if warm:
                fits += min(warm, spec.count, spec.parallelism)
                text += f"\n  + {warm} waiting Pod(s) of its warm pool"
        if fits >= spec.parallelism:
            return []
        message = f"the cluster has room for {fits} of {spec.parallelism} sandboxes: {text}"
        if spec.capacity_check == "error":
            raise CapacityError(message + "\n(set capacity_check to 'warn' to run anyway)")
        return [message]

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> RunHandle:
        namespace = namespace_name(spec.batch_id)
        # The receipt names everything before the first mutation.
        record({"context": self.context, "namespace": namespace, "run_id": spec.batch_id})
        # Warm sandboxes first (claimed and handed their episodes): they run while the cold
        # part is being created.
        started = time.time()
        key = self.pool_key(spec)
        claimed = self.pools.claim(spec, key, record, time.time) if key else []
        if claimed:
            record({"warm": [[c.index, c.name, c.uid] for c in claimed]})
            started = min(started, *(c.claimed_at for c in claimed))
        # More episodes than slots, and a pool to take them from: every slot is fed from the
        # pool as it frees (`feed_run`), not by a Job whose next wave starts cold once its
        # controller sees the last one end.
        fed = bool(claimed) and spec.count > spec.parallelism
        ns = self._create_or_adopt(
            spec,
            "namespace",
            namespace_manifest(spec),
            self.core.create_namespace,
            self.core.read_namespace,
            namespace,
        )
        record({"uid": ns["metadata"]["uid"]})
        try:
            configmap = configmap_manifest(spec, self.program)
        except ValueError as exc:  # the tasks do not fit in a ConfigMap
            raise BackendError(str(exc)) from exc
        self._create_or_adopt(
            spec,
            "configmap",
            configmap,
            self.core.create_namespaced_config_map,
            self.core.read_namespaced_config_map,
            "episode",
            namespace,
        )
        self._create_or_adopt(
            spec,
            "networkpolicy",
            network_policy_manifest(spec),
            self.net.create_namespaced_network_policy,
            self.net.read_namespaced_network_policy,
            "deny-all",
            namespace,
        )
        jobs: dict[str, str] = {}
        created: list[dict[str, Any]] = []
        warm = set(range(spec.count)) if fed else {c.index for c in claimed}
        for part in job_parts(spec, warm):  # one Job per image and run of cold episodes
            manifest = job_manifest(
                spec, ttl_seconds_after_finished=self.settings.kube_job_ttl_seconds, part=part
            )
            job = self._create_or_adopt(
                spec,
                "job",
                manifest,
                self.batch.create_namespaced_job,
                self.batch.read_namespaced_job,
                part.name,
                namespace,
            )
            jobs[part.name] = job["metadata"]["uid"]
            created.append(job)
            record({"job_uid": created[0]["metadata"]["uid"], "jobs": dict(jobs)})
        if not claimed:
            origin = ts(created[0]["metadata"]["creationTimestamp"]) or 0.0
        else:
            # The first claim, or (with cold Pods too, whose creation times are whole seconds)
            # the second it falls in: no sandbox of the run is created before its origin.
            origin = math.floor(started) if created else started
        return RunHandle(
            backend=self.name,
            batch_id=spec.batch_id,
            origin=origin,
            episode_prefix=JOB_NAME,  # Pod names add a random suffix once created
            context=self.context,
            infra_retries=spec.infra_retries,
            namespace=namespace,
            namespace_uid=ns["metadata"]["uid"],
            job_name=JOB_NAME if created else None,
            job_uid=created[0]["metadata"]["uid"] if created else None,
            jobs=jobs,
            pool_namespace=objects.pool_namespace(key) if claimed and key else None,
            warm=[[c.index, c.name, c.uid] for c in claimed],
            fed=fed,
        )

    def _create_or_adopt(
        self,
        spec: BatchSpec,
        kind: str,
        manifest: dict[str, Any],
        create: Callable[..., Any],
        read: Callable[..., Any],
        *read_args: str,
    ) -> dict[str, Any]:
        """Create the object; if it exists, adopt it only when its labels prove it is ours."""
        create_args = (read_args[1],) if len(read_args) > 1 else ()
        try:
            return self._call(f"create {kind}", create, *create_args, manifest)
        except ResourceConflict:
            existing = self._call(f"read {kind}", read, *read_args)
        labels = existing["metadata"].get("labels") or {}
        if not _labelled_ours(existing, spec.batch_id):
            raise OwnershipError(
                f"{kind} {'/'.join(read_args)} exists but is not ours "
                f"(labels {labels}); refusing to use it"
            )
        return existing

    def _follow(
        self,
        what: str,
        list_fn: Callable[..., Any],
        namespace: str,
        done: Callable[[dict[str, dict[str, Any]]], bool],
        timeout: float,
        **selector: str,
    ) -> dict[str, dict[str, Any]]:
        """List objects, then watch them (from the list's resourceVersion) until `done` holds
        or `timeout` passes. Returns the objects by UID as last seen."""
        listing = self._call(f"list {what}", list_fn, namespace, **selector)
        objects = {o["metadata"]["uid"]: o for o in listing.get("items", [])}
        if done(objects) or timeout <= 0:
            return objects
        stream = RawWatch()
        try:
            for event in stream.stream(
                list_fn,
                namespace,
                resource_version=listing["metadata"]["resourceVersion"],
                timeout_seconds=max(1, math.ceil(timeout)),
                _request_timeout=timeout + 10,
                **selector,
            ):
                obj = event["raw_object"]
                if event["type"] == "DELETED":
                    objects.pop(obj["metadata"]["uid"], None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    objects[obj["metadata"]["uid"]] = obj
                if done(objects):
                    break
        except ApiException as exc:
            if exc.status != 410:  # 410 Gone: our resourceVersion expired; report what we saw
                raise _translate(exc, f"watch {what}") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise _translate(exc, f"watch {what}") from exc
        finally:
            stream.stop()
        return objects

    def _pod_watch(self, handle: RunHandle) -> PodWatch:
        return self._batch_watch(_namespace(handle), handle.batch_id, _namespace(handle))

    def _warm_watch(self, handle: RunHandle) -> PodWatch:
        """The batch's warm Pods, in their pool's namespace."""
        namespace = handle.pool_namespace or ""
        return self._batch_watch(namespace, handle.batch_id, f"{namespace}/{handle.batch_id}")

    def _batch_watch(self, namespace: str, batch_id: str, name: str) -> PodWatch:
        """The shared watch of one batch's Pods in `namespace` (made on first use)."""
        selector = f"{k.LABEL_BATCH}={batch_id}"

        def make() -> PodWatch:
            return PodWatch(
                name,
                lambda: self._call(
                    "list pods", self.core.list_namespaced_pod, namespace, label_selector=selector
                ),
                (self.core.list_namespaced_pod, (namespace,), {"label_selector": selector}),
                completion_index,
            )

        return self.watches.get(name, make)

    def wait_episode(
        self, handle: RunHandle, index: int, timeout: float, *, until_ready: bool = False
    ) -> EpisodeObservation:
        warm = handle.warm_pod(index) is not None

        def done(seen: dict[str, dict[str, Any]]) -> bool:
            return _ended(handle, index, seen) or (
                until_ready and observe_pods(handle, index, seen).ready
            )

        if handle.in_pool(index):
            pods = self._warm_watch(handle).wait(index, timeout, done)
            obs = observe_pods(handle, index, pods, final=True)
            if warm and not pods:
                # The watch has listed the pool: the Pod this episode claimed is gone (its
                # hand-over failed, or it was deleted before any watch of ours saw it end).
                obs.phase = "Failed"
                obs.reason = "its warm Pod was deleted before it could be read"
            return obs
        pods = self._pod_watch(handle).wait(index, timeout, done)
        obs = observe_pods(handle, index, pods)
        if not obs.terminal and not pods:
            obs = self._ended_without_pod(handle, index, obs)
        elif (obs.reason or "").startswith(RETRYING) and self._no_retry_coming(handle, index):
            obs = observe_pods(handle, index, pods, final=True)
        return obs

    def wait_ended(
        self, handle: RunHandle, indexes: list[int], timeout: float, *, ready: AbstractSet[int]
    ) -> list[int]:
        def done(index: int, pods: dict[str, dict[str, Any]]) -> bool:
            return _ended(handle, index, pods) or (
                index in ready and observe_pods(handle, index, pods).ready
            )

        pooled = [i for i in indexes if handle.in_pool(i)]
        cold = [i for i in indexes if not handle.in_pool(i)]
        if pooled and cold:
            # Two watches: look at the pool's at once, wait on the batch's a little at a time.
            ended = self._warm_watch(handle).wait_any(pooled, 0, done, caller=WAKER)
            if ended:
                return ended
            timeout = min(timeout, MIXED_WAIT_SECONDS)
        watch = self._pod_watch(handle) if cold else self._warm_watch(handle)
        return watch.wait_any(cold or pooled, timeout, done, caller=WAKER)

    def _no_retry_coming(self, handle: RunHandle, index: int) -> bool:
        """The Job will not replace this index's failed Pod: it ended, or counted the index
        failed (its budget, as the controller counts it, is spent)."""
        found = job_of(self._recent_jobs(handle), index)
        if found is None:
            return True
        job, local = found
        _, verdict = job_verdict(job)
        failed = (job.get("status") or {}).get("failedIndexes") or ""
        return verdict != "Running" or index_in(failed, local)

    def _ended_without_pod(
        self, handle: RunHandle, index: int, obs: EpisodeObservation
    ) -> EpisodeObservation:
        """No Pod for this index: if its Job has ended, the episode ended with it."""
        found = job_of(self._recent_jobs(handle), index)
        if found is None:
            return obs
        job, local = found
        _, verdict = job_verdict(job)
        if verdict != "Running":
            reasons = [
                c.get("reason")
                for c in (job.get("status") or {}).get("conditions") or []
                if c.get("type") == verdict
            ]
            obs.phase = "Failed"
            status = job.get("status") or {}
            if index_in(status.get("failedIndexes") or "", local):
                # The Job counted this index failed: its Pod ended (failed, or was deleted)
                # before any watch of ours saw it.
                obs.reason = f"Job {verdict}: its Pod failed or was deleted before it could be read"
            else:
                obs.reason = (
                    f"Job {verdict}: {reasons[0] if reasons else '?'}; no Pod of this episode "
                    "is left to read"
                )
        return obs

    def _list_jobs(self, handle: RunHandle) -> list[dict[str, Any]]:
        """The run's Jobs (one per image), in the order they were created."""
        listing = self._call(
            "list jobs",
            self.batch.list_namespaced_job,
            _namespace(handle),
            label_selector=f"{k.LABEL_BATCH}={handle.batch_id}",
        )
        order = list(handle.job_uids())
        items = [j for j in listing.get("items", []) if j["metadata"]["name"] in order]
        return sorted(items, key=lambda j: order.index(j["metadata"]["name"]))

    def _recent_jobs(self, handle: RunHandle) -> list[dict[str, Any]]:
        """The run's Jobs as listed at most JOB_CACHE_SECONDS ago: the collectors of episodes
        with no Pod yet share one read instead of one each."""
        namespace = _namespace(handle)
        with self._jobs_lock:
            read_at, jobs = self._jobs.get(namespace, (0.0, []))
            if time.monotonic() - read_at > JOB_CACHE_SECONDS:
                jobs = self._list_jobs(handle)
                self._jobs[namespace] = (time.monotonic(), jobs)
            return jobs

    def resume_run(self, handle: RunHandle) -> None:
        """Nothing to do: the Job controller is the cluster's, and it does not die with us."""

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        """The episode's log: its container's, or (graded apart) its agent's init container's
        followed by its grader's."""
        return "".join(
            self._container_log(handle, obs, name)
            for name in obs.log_containers or [CONTAINER_NAME]
        )

    def _container_log(self, handle: RunHandle, obs: EpisodeObservation, container: str) -> str:
        try:
            text = self._text(
                f"log of {obs.episode_id}",
                self.core.read_namespaced_pod_log,
                obs.episode_id,
                handle.pool_namespace if handle.in_pool(obs.index) else _namespace(handle),
                container=container,
                limit_bytes=MAX_LOG_BYTES,
            )
        except (ResourceNotFound, BackendError) as exc:
            if isinstance(exc, TransientBackendError):
                raise
            # Validation reports the missing events (and any termination message); a grader
            # that never started (its agent failed) has no log to read.
            return ""
        if len(text.encode("utf-8", "replace")) >= MAX_LOG_BYTES:
            # The API server stopped at our limit: say so in the log, never pass it off whole.
            text += f"\n[rollout: log read cut at {MAX_LOG_BYTES} bytes]\n"
        return text

    def _settled_jobs(self, handle: RunHandle) -> list[dict[str, Any]]:
        """The run's Jobs once their controller has marked each Complete or Failed (it does
        so shortly after the last Pod ends), or as they are after JOB_SETTLE_SECONDS."""
        names = handle.job_uids()
        try:
            seen = self._follow(
                "jobs",
                self.batch.list_namespaced_job,
                _namespace(handle),
                lambda found: (
                    sum(
                        1
                        for j in found.values()
                        if j["metadata"]["name"] in names and job_verdict(j)[1] != "Running"
                    )
                    >= len(names)
                ),
                JOB_SETTLE_SECONDS,
                label_selector=f"{k.LABEL_BATCH}={handle.batch_id}",
            )
        except BackendError:
            return self._list_jobs(handle)  # the records then show the Jobs as they are now
        order = list(names)
        jobs = [j for j in seen.values() if j["metadata"]["name"] in names]
        return sorted(jobs, key=lambda j: order.index(j["metadata"]["name"]))

    def _warm_pods(self, handle: RunHandle) -> list[dict[str, Any]]:
        if not handle.warm or not handle.pool_namespace:
            return []
        listing = self._call(
            "list warm pods",
            self.core.list_namespaced_pod,
            handle.pool_namespace,
            label_selector=f"{k.LABEL_BATCH}={handle.batch_id}",
        )
        return list(listing.get("items", []))

    def _verdict(
        self, handle: RunHandle, jobs: list[dict[str, Any]], warm: list[dict[str, Any]]
    ) -> tuple[float | None, str]:
        """How the run ended: its Jobs' verdict, and its warm Pods' (Complete when every one
        succeeded; Running while one has not ended or has not been seen)."""
        if not handle.warm:
            return jobs_verdict(jobs)
        phases = [_ended_phase(p) for p in warm]
        ended = [
            ts(s.get("state", {}).get("terminated", {}).get("finishedAt"))
            for p in warm
            for s in (p.get("status") or {}).get("containerStatuses") or []
        ]
        if len(warm) < len(handle.warm) or any(ph not in ("Succeeded", "Failed") for ph in phases):
            warm_verdict: tuple[float | None, str] = (None, "Running")
        else:
            when = max((t for t in ended if t is not None), default=None)
            warm_verdict = (when, "Complete" if set(phases) == {"Succeeded"} else "Failed")
        if not handle.job_uids():
            return warm_verdict
        at, verdict = jobs_verdict(jobs)
        if "Running" in (verdict, warm_verdict[1]):
            return None, "Running"
        when = max((t for t in (at, warm_verdict[0]) if t is not None), default=None)
        both = {verdict, warm_verdict[1]}
        return when, "Complete" if both == {"Complete"} else sorted(both - {"Complete"})[0]

    def run_status(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        jobs = self._list_jobs(handle) if handle.job_uids() else []
        completed_at, verdict = self._verdict(handle, jobs, self._warm_pods(handle))
        return FinishedRun(completed_at=completed_at, verdict=verdict)

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        namespace = _namespace(handle)
        jobs = self._settled_jobs(handle) if handle.job_uids() else []
        pods = self._call(
            "list pods",
            self.core.list_namespaced_pod,
            namespace,
            label_selector=f"{k.LABEL_BATCH}={handle.batch_id}",
        )
        warm = self._warm_pods(handle)
        events = self._call("list events", self.core.list_namespaced_event, namespace)
        completed_at, verdict = self._verdict(handle, jobs, warm)
        records = {
            "pods.json": pretty_json([*warm, *pods.get("items", [])]),
            "events.txt": events_text(events.get("items", [])),
        }
        # The guide's job.json and job-submitted.json are the first Job's; a batch of several
        # images (or warm episodes between cold ones) adds job-<name>.json and
        # job-<name>-submitted.json for the others.
        in_pool = set(range(spec.count)) if handle.fed else {index for index, _, _ in handle.warm}
        for part in job_parts(spec, in_pool):
            name = "job" if part.name == JOB_NAME else f"job-{part.name}"
            job = next((j for j in jobs if j["metadata"]["name"] == part.name), None)
            if job is not None:
                records[f"{name}.json"] = pretty_json(job)
            submitted = job_manifest(
                spec, ttl_seconds_after_finished=self.settings.kube_job_ttl_seconds, part=part
            )
            records[f"{name}-submitted.json"] = pretty_json(submitted)
        return FinishedRun(records=records, completed_at=completed_at, verdict=verdict)

    def cancel_run(self, handle: RunHandle) -> None:
        """Suspend the Jobs: their controller deletes the running Pods and starts no more, and
        the Jobs stay (with their records) until the run is deleted. Warm Pods get a deadline
        that has passed: the kubelet stops them, and they stay as records too. A fed run's
        Pods are found by its label too (the feeder may have claimed one since the receipt
        was read)."""
        stop = {name: uid for _index, name, uid in handle.warm}
        if handle.fed:
            stop |= {p["metadata"]["name"]: p["metadata"]["uid"] for p in self._warm_pods(handle)}
        for name, uid in stop.items():
            with contextlib.suppress(ResourceNotFound, ResourceConflict):
                self._call(
                    "stop warm pod",
                    self.core.patch_namespaced_pod,
                    name,
                    handle.pool_namespace,
                    {"metadata": {"uid": uid}, "spec": {"activeDeadlineSeconds": 1}},
                )
        for name in handle.job_uids():
            with contextlib.suppress(ResourceNotFound):
                self._call(
                    "suspend job",
                    self.batch.patch_namespaced_job,
                    name,
                    _namespace(handle),
                    {"spec": {"suspend": True}},
                )

    def list_runs(self) -> list[str]:
        selector = f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE},!{k.LABEL_POOL}"  # not the pools
        found = self._call("list namespaces", self.core.list_namespace, label_selector=selector)
        return [
            (ns["metadata"].get("labels") or {}).get(k.LABEL_BATCH, ns["metadata"]["name"])
            for ns in found.get("items", [])
        ]

    def delete_run(self, handle: RunHandle) -> bool:
        """Delete the batch's namespace (it takes the Job, Pods and the rest with it) once its
        UID and labels, and the Job's UID, match the receipt. Does not wait: True once the
        namespace is gone, False while Kubernetes is still deleting it."""
        namespace = _namespace(handle)
        warm_gone = (
            self.pools.delete_claimed(handle.pool_namespace, handle.batch_id, handle.warm)
            if handle.warm and handle.pool_namespace
            else True
        )

        def prove(ns: dict[str, Any]) -> None:
            labels = ns["metadata"].get("labels") or {}
            uid = ns["metadata"]["uid"]
            if uid != handle.namespace_uid or not _labelled_ours(ns, handle.batch_id):
                raise OwnershipError(
                    f"namespace {namespace} has uid {uid} and labels {labels}; "
                    f"the receipt says uid {handle.namespace_uid} and batch "
                    f"{handle.batch_id}: refusing to delete what we cannot prove we created"
                )

        def jobs_ours(_ns: dict[str, Any]) -> bool:
            for name, uid in (handle.job_uids() or {JOB_NAME: None}).items():
                with contextlib.suppress(ResourceNotFound):
                    job = self._call("read job", self.batch.read_namespaced_job, name, namespace)
                    job_labels = job["metadata"].get("labels") or {}
                    # A run cut short before the Job's UID was recorded (a CLI killed mid-run,
                    # whose receipt.json names the namespace UID only): the Job's labels are
                    # the proof.
                    if (uid is not None and job["metadata"]["uid"] != uid) or (
                        uid is None and not _labelled_ours(job, handle.batch_id)
                    ):
                        raise OwnershipError(
                            f"Job {namespace}/{name} has uid {job['metadata']['uid']} and "
                            f"labels {job_labels}, the receipt says uid {uid}: refusing to "
                            "delete its namespace"
                        )
            return True

        gone = delete_namespace(self._call, self.core, namespace, "namespace", prove, jobs_ours)
        return gone and warm_gone

    # -- warm pools (backends/warm.py, kube/pools.py) ---------------------------------------
    def pool_key(self, spec: BatchSpec) -> str | None:
        # A warm Pod is one container: a batch that grades in a second one starts cold; one
        # whose runner grades in its agent's container (stashes_tests) takes warm Pods, its
        # hidden tests handed over apart from the task.
        if grades_apart(spec):
            return None
        return warm.pool_key(spec, self.program, grades_within=True)

    def fill_pool(
        self, spec: BatchSpec, size: int, budget: int, idle_seconds: float, record: ReceiptUpdate
    ) -> dict[str, int]:
        """Make the pool of the batch's shape hold `size` waiting Pods (within `budget` waiting
        Pods over all pools); `record` gets the pool's namespace before it is created."""
        key = self.pool_key(spec)
        if key is None:
            raise BackendError("this batch's shape has no pool (several images or retries)")
        self.pools.ensure(spec, key, self.program, record)
        return self.pools.fill(spec, key, size, budget, idle_seconds)

    def drain_pool(self, key: str, namespace_uid: str | None) -> bool:
        return self.pools.drain(key, namespace_uid)

    def _pool_watch(self, key: str) -> PodWatch:
        """Every Pod of one pool (the feeder's view: waiting, starting, claimed)."""
        namespace = objects.pool_namespace(key)
        selector = f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE},{k.LABEL_POOL}={key}"

        def make() -> PodWatch:
            return PodWatch(
                f"pool {key}",
                lambda: self._call(
                    "list pool pods",
                    self.core.list_namespaced_pod,
                    namespace,
                    label_selector=selector,
                ),
                (self.core.list_namespaced_pod, (namespace,), {"label_selector": selector}),
                lambda _pod: 0,  # one group: the feeder reads the whole pool at once
            )

        return self.watches.get(f"pool/{key}", make)

    def feed_run(
        self,
        spec: BatchSpec,
        handle: RunHandle,
        claims: list[list[Any]],
        record: ReceiptUpdate,
        *,
        timeout: float,
        budget: int,
        idle_seconds: float,
    ) -> Fed:
        key = self.pool_key(spec)
        if key is None or not handle.fed or handle.pool_namespace is None:
            return Fed(claims, done=True)
        namespace, watch = handle.pool_namespace, self._pool_watch(key)
        claims = [list(c) for c in claims]
        end = time.monotonic() + timeout
        filled_at = -math.inf

        def plan_of(pods: dict[str, dict[str, Any]]) -> read.FeedPlan:
            return read.feed_plan(
                pods.values(),
                spec.batch_id,
                spec.parallelism,
                spec.count,
                claims,
                ahead=FEED_AHEAD_WAVES * spec.parallelism,
            )

        def actionable(pods: dict[str, dict[str, Any]]) -> bool:
            plan = plan_of(pods)
            top_up = plan.idle_have < plan.idle_wanted
            return (
                plan.done
                or bool(plan.claims or plan.found)
                or (top_up and time.monotonic() - filled_at >= FEED_FILL_EVERY_SECONDS)
            )

        while True:
            left = end - time.monotonic()
            if left <= 0:
                return Fed(claims, done=False)
            plan = plan_of(watch.wait(0, min(left, FEED_FILL_EVERY_SECONDS), actionable))
            if plan.found:
                # Claimed by a look that died before its record: recorded now, handed over
                # unless its runner already has its episode.
                claims += plan.found
                record({"warm": claims})
                for index, name, uid in plan.found:
                    self.pools.hand_over_again(spec, namespace, Claimed(index, name, uid, 0.0))
            if plan.done:
                return Fed(claims, done=True)
            if plan.claims:
                record(
                    {
                        "feed_planned": {
                            str(i): [p["metadata"]["name"], p["metadata"]["uid"]]
                            for i, p in plan.claims
                        }
                    }
                )
                taken = self.pools.take(spec, namespace, plan.claims, time.time)
                claims += [[c.index, c.name, c.uid] for c in taken]
                record({"warm": claims})
            if plan.idle_have < plan.idle_wanted and (
                time.monotonic() - filled_at >= FEED_FILL_EVERY_SECONDS
            ):
                filled_at = time.monotonic()
                # The pool ahead of the batch: its own count (a list) decides what
                # is created, so a look racing a watch that has not seen its Pods yet does
                # not create them twice.
                self.pools.fill(spec, key, plan.idle_wanted, budget, idle_seconds)

    def list_pools(self) -> dict[str, dict[str, Any]]:
        """Pool key -> {namespace, uid, waiting, claimed_running, pods} of every pool namespace
        of ours (claimed_running: its Running Pods a batch has claimed)."""
        selector = f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE},{k.LABEL_POOL}"
        found = self._call("list namespaces", self.core.list_namespace, label_selector=selector)
        pools: dict[str, dict[str, Any]] = {}
        for ns in found.get("items", []):
            key = ns["metadata"]["labels"][k.LABEL_POOL]
            pods = self.pools.pods(key)
            running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
            pools[key] = {
                "namespace": ns["metadata"]["name"],
                "uid": ns["metadata"]["uid"],
                "waiting": sum(1 for p in pods if read.pool_pod_waiting(p)),
                "claimed_running": sum(
                    1 for p in running if k.LABEL_BATCH in (p["metadata"].get("labels") or {})
                ),
                "pods": len(pods),
            }
        return pools


def _labelled_ours(obj: dict[str, Any], batch_id: str) -> bool:
    """Whether an object carries our owner label and this batch's label."""
    labels = obj["metadata"].get("labels") or {}
    return bool(
        labels.get(k.LABEL_OWNER) == k.LABEL_OWNER_VALUE and labels.get(k.LABEL_BATCH) == batch_id
    )


def _namespace(handle: RunHandle) -> str:
    if not handle.namespace:
        raise BackendError(f"run of batch {handle.batch_id} names no namespace")
    return handle.namespace


def _ended_phase(pod: dict[str, Any]) -> str | None:
    """A Pod's phase, or the one its containers already decided: the kubelet moves the phase
    about a second after the last container exits, and a run's records are read at once."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    containers = status.get("containerStatuses") or []
    if phase in ("Succeeded", "Failed") or not containers:
        return phase
    ended = [(c.get("state") or {}).get("terminated") or {} for c in containers]
    if not all(ended):
        return phase
    return "Succeeded" if all(e.get("exitCode") == 0 for e in ended) else "Failed"

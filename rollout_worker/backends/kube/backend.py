"""The Kubernetes backend: one namespace and one Indexed Job per image of a batch.

`KubernetesBackend` is the Backend protocol over modules that each do one thing: `api.py` is
the edge (clients, calls, every API error translated), `objects.py` and `pod_spec.py` build
the objects and `read.py` / `verdicts.py` read them (all four pure), `watch.py` is the shared
Pod watch, `pools.py` the warm pools and `feed.py` their feeder loop, `namespaces.py` the
ownership-checked delete. What is left here: which call comes when.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from kubernetes import client

from rollout_wire import constants as k
from rollout_wire.errors import (
    BackendError,
    CapacityError,
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
    KubeRunHandle,
    ReceiptUpdate,
    RunHandle,
    handle_as,
)
from rollout_worker.backends.kube import api, objects, read, task_env, task_secret, verdicts
from rollout_worker.backends.kube.feed import feed
from rollout_worker.backends.kube.namespaces import delete_batch_namespace
from rollout_worker.backends.kube.objects import (
    JOB_NAME,
    batch_selector,
    configmap_manifest,
    job_manifest,
    job_parts,
    namespace_manifest,
    namespace_name,
    network_policy_manifest,
)
from rollout_worker.backends.kube.pod_spec import CONFIGMAP_NAME, CONTAINER_NAME, grades_apart
from rollout_worker.backends.kube.pools import WarmPools
from rollout_worker.backends.kube.read import (
    RETRYING,
    capacity_plan,
    completion_index,
    episode_ended,
    observe_pods,
    ts,
)
from rollout_worker.backends.kube.watch import PodWatch, PodWatches
from rollout_worker.observation import EpisodeObservation
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings

JOB_CACHE_SECONDS = 1.0
JOB_SETTLE_SECONDS = 25  # after the report; well under the visibility timeout
# A waker whose parked episodes run both in a pool and in the Job waits on the Job's watch this
# long at a time, looking at the pool's in between.
MIXED_WAIT_SECONDS = 1.0
# `wait_ended`'s caller, the batch's waker (one per batch and process): its watch remembers
# what it checked, so each call checks only what changed.
WAKER = "waker"


def _namespace(handle: KubeRunHandle) -> str:
    if not handle.namespace:
        raise BackendError(f"run of batch {handle.batch_id} names no namespace")
    return handle.namespace


class KubernetesBackend:
    name = "kubernetes"
    streams_progress = False  # a Pod cannot reach Redis: collectors stream what they watch

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.api, self.context = api.api_client(settings)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.nodes_api = client.NodeV1Api(self.api)
        self.net = client.NetworkingV1Api(self.api)
        self.watches = PodWatches()
        self.pools = WarmPools(
            self._call,
            self._text,
            self.core,
            self.net,
            settings.warm_handover_threads_used,
            settings.warm_handover_from,
        )
        self.program = episode_program_text()  # read once: pool keys, ConfigMaps
        self._jobs: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._jobs_lock = threading.Lock()

    # -- the edge: every call goes through api.py ----------------------------------------------
    _call = staticmethod(api.call)
    _text = staticmethod(api.text)

    # -- protocol ----------------------------------------------------------------------------
    def preflight(self, spec: BatchSpec) -> list[str]:
        task_secret.source_for(self._call, self.core, spec, self.settings)
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

    def start_run(self, spec: BatchSpec, record: ReceiptUpdate) -> KubeRunHandle:
        namespace = namespace_name(spec.batch_id)
        # The receipt names everything before the first mutation.
        record({"context": self.context, "namespace": namespace, "run_id": spec.batch_id})
        # Warm sandboxes first (claimed and handed their episodes): they run while the cold
        # part is being created.
        started = time.time()
        key = self.pool_key(spec)
        claimed = self.pools.claim(spec, key, record, time.time) if key else []
        if claimed:
            record({"warm": [c.claim.to_list() for c in claimed]})
            started = min(started, *(c.claimed_at for c in claimed))
        # More episodes than slots, and a pool to take them from: every slot is fed from the
        # pool as it frees (`feed_run`), not by a Job whose next wave starts cold once its
        # controller sees the last one end.
        fed = bool(claimed) and spec.count > spec.parallelism
        ns = self._create_namespace(spec, namespace, record)
        warm = set(range(spec.count)) if fed else {c.index for c in claimed}
        jobs, created = self._create_jobs(spec, namespace, warm, record)
        if not claimed:
            origin = ts(created[0]["metadata"]["creationTimestamp"]) or 0.0
        else:
            # The first claim, or (with cold Pods too, whose creation times are whole seconds)
            # the second it falls in: no sandbox of the run is created before its origin.
            origin = math.floor(started) if created else started
        return KubeRunHandle(
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
            warm=tuple(c.claim for c in claimed),
            fed=fed,
        )

    def _create_namespace(
        self, spec: BatchSpec, namespace: str, record: ReceiptUpdate
    ) -> dict[str, Any]:
        """The batch's namespace (its UID recorded at once), its task env Secret (read first:
        kube/task_secret.py), ConfigMap and NetworkPolicy."""
        source = task_secret.source_for(self._call, self.core, spec, self.settings)
        ns = api.create_or_adopt(
            spec.batch_id,
            "namespace",
            namespace_manifest(spec),
            self.core.create_namespace,
            self.core.read_namespace,
            namespace,
        )
        record({"uid": ns["metadata"]["uid"]})
        task_secret.create_copy(self._call, self.core, spec, source, namespace)
        try:
            configmap = configmap_manifest(spec, self.program)
        except ValueError as exc:  # the tasks do not fit in a ConfigMap
            raise BackendError(str(exc)) from exc
        api.create_or_adopt(
            spec.batch_id,
            "configmap",
            configmap,
            self.core.create_namespaced_config_map,
            self.core.read_namespaced_config_map,
            CONFIGMAP_NAME,
            namespace,
        )
        api.create_or_adopt(
            spec.batch_id,
            "networkpolicy",
            network_policy_manifest(spec),
            self.net.create_namespaced_network_policy,
            self.net.read_namespaced_network_policy,
            "deny-all",
            namespace,
        )
        return ns

    def _create_jobs(
        self, spec: BatchSpec, namespace: str, warm: set[int], record: ReceiptUpdate
    ) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """One Job per image and run of cold episodes (not `warm`), each recorded once made:
        their names -> UIDs, and the Jobs."""
        jobs: dict[str, str] = {}
        created: list[dict[str, Any]] = []
        for part in job_parts(spec, warm):
            manifest = job_manifest(
                spec, ttl_seconds_after_finished=self.settings.kube_job_ttl_seconds, part=part
            )
            job = api.create_or_adopt(
                spec.batch_id,
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
        return jobs, created

    # -- watches: one shared watch per batch (and pool) and process -----------------------------
    def _watch(
        self,
        key: str,
        name: str,
        what: str,
        namespace: str,
        selector: str,
        index_of: Callable[..., Any],
    ) -> PodWatch:
        """The shared watch `key` (`name` in its logs) of the Pods `selector` picks in
        `namespace`, listed as `what` (made on first use)."""

        def make() -> PodWatch:
            return PodWatch(
                name,
                lambda: self._call(
                    what, self.core.list_namespaced_pod, namespace, label_selector=selector
                ),
                (self.core.list_namespaced_pod, (namespace,), {"label_selector": selector}),
                index_of,
            )

        return self.watches.get(key, make)

    def _batch_watch(self, namespace: str, batch_id: str, name: str) -> PodWatch:
        """One batch's Pods in `namespace`, by episode index."""
        selector = batch_selector(batch_id)
        return self._watch(name, name, "list pods", namespace, selector, completion_index)

    def _pod_watch(self, handle: KubeRunHandle) -> PodWatch:
        return self._batch_watch(_namespace(handle), handle.batch_id, _namespace(handle))

    def _warm_watch(self, handle: KubeRunHandle) -> PodWatch:
        """The batch's warm Pods, in their pool's namespace."""
        namespace = handle.pool_namespace or ""
        return self._batch_watch(namespace, handle.batch_id, f"{namespace}/{handle.batch_id}")

    def _pool_watch(self, key: str) -> PodWatch:
        """Every Pod of one pool (the feeder's view: waiting, starting, claimed), as one group:
        the feeder reads the whole pool at once."""
        namespace = objects.pool_namespace(key)
        selector = objects.pool_selector(key)
        return self._watch(
            f"pool/{key}", f"pool {key}", "list pool pods", namespace, selector, lambda _pod: 0
        )

    def wait_episode(
        self, handle: RunHandle, index: int, timeout: float, *, until_ready: bool = False
    ) -> EpisodeObservation:
        handle = handle_as(KubeRunHandle, handle)
        warm = handle.warm_pod(index) is not None

        def done(seen: dict[str, dict[str, Any]]) -> bool:
            return episode_ended(handle, index, seen) or (
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
            obs = verdicts.ended_without_pod(self._recent_jobs(handle), index, obs)
        elif (obs.reason or "").startswith(RETRYING) and verdicts.no_retry_coming(
            self._recent_jobs(handle), index
        ):
            obs = observe_pods(handle, index, pods, final=True)
        return obs

    def wait_ended(
        self, handle: RunHandle, indexes: list[int], timeout: float, *, ready: AbstractSet[int]
    ) -> list[int]:
        handle = handle_as(KubeRunHandle, handle)

        def done(index: int, pods: dict[str, dict[str, Any]]) -> bool:
            return episode_ended(handle, index, pods) or (
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

    # -- a run's Jobs and warm Pods, as listed ---------------------------------------------------
    def _list_jobs(self, handle: KubeRunHandle) -> list[dict[str, Any]]:
        """The run's Jobs (one per image), in the order they were created."""
        listing = self._call(
            "list jobs",
            self.batch.list_namespaced_job,
            _namespace(handle),
            label_selector=batch_selector(handle.batch_id),
        )
        return verdicts.in_job_order(listing.get("items", []), handle.job_uids())

    def _recent_jobs(self, handle: KubeRunHandle) -> list[dict[str, Any]]:
        """The run's Jobs as listed at most JOB_CACHE_SECONDS ago: the collectors of episodes
        with no Pod yet share one read instead of one each."""
        namespace = _namespace(handle)
        with self._jobs_lock:
            read_at, jobs = self._jobs.get(namespace, (0.0, []))
            if time.monotonic() - read_at > JOB_CACHE_SECONDS:
                jobs = self._list_jobs(handle)
                self._jobs[namespace] = (time.monotonic(), jobs)
            return jobs

    def _settled_jobs(self, handle: KubeRunHandle) -> list[dict[str, Any]]:
        """The run's Jobs once their controller has marked each Complete or Failed (it does
        so shortly after the last Pod ends), or as they are after JOB_SETTLE_SECONDS."""
        names = handle.job_uids()
        try:
            seen = api.follow(
                "jobs",
                self.batch.list_namespaced_job,
                _namespace(handle),
                lambda found: verdicts.jobs_ended(found.values(), names),
                JOB_SETTLE_SECONDS,
                label_selector=batch_selector(handle.batch_id),
            )
        except BackendError:
            return self._list_jobs(handle)  # the records then show the Jobs as they are now
        return verdicts.in_job_order(seen.values(), names)

    def _warm_pods(self, handle: KubeRunHandle, settle: float = 0.0) -> list[dict[str, Any]]:
        """The run's warm Pods; with `settle`, once each has ended (its containers exited: the
        report comes before the kubelet says so) or as they are after `settle` seconds."""
        if not handle.warm or not handle.pool_namespace:
            return []
        found = api.follow(
            "warm pods",
            self.core.list_namespaced_pod,
            handle.pool_namespace,
            lambda pods: verdicts.warm_ended(pods.values(), len(handle.warm)),
            settle,
            label_selector=batch_selector(handle.batch_id),
        )
        return list(found.values())

    def resume_run(self, handle: RunHandle) -> None:
        """Nothing to do: the Job controller is the cluster's, and it does not die with us."""

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        """The episode's log: its container's, or (graded apart) its agent's init container's
        followed by its grader's."""
        handle = handle_as(KubeRunHandle, handle)
        return "".join(
            self._container_log(handle, obs, name)
            for name in obs.log_containers or [CONTAINER_NAME]
        )

    def _container_log(self, handle: KubeRunHandle, obs: EpisodeObservation, container: str) -> str:
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

    # -- records, cancel, delete -----------------------------------------------------------------
    def run_status(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        handle = handle_as(KubeRunHandle, handle)
        jobs = self._list_jobs(handle) if handle.job_uids() else []
        completed_at, verdict = verdicts.run_verdict(handle, jobs, self._warm_pods(handle))
        return FinishedRun(completed_at=completed_at, verdict=verdict)

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> FinishedRun:
        handle = handle_as(KubeRunHandle, handle)
        namespace = _namespace(handle)
        settle_until = time.monotonic() + JOB_SETTLE_SECONDS
        jobs = self._settled_jobs(handle) if handle.job_uids() else []
        # Warm Pods settle in the time left: the receipt's completed_at, as with a Job's.
        warm = self._warm_pods(handle, max(0.0, settle_until - time.monotonic()))
        pods = self._call(
            "list pods",
            self.core.list_namespaced_pod,
            namespace,
            label_selector=batch_selector(handle.batch_id),
        )
        events = self._call("list events", self.core.list_namespaced_event, namespace)
        completed_at, verdict = verdicts.run_verdict(handle, jobs, warm)
        records = read.run_records(
            spec,
            handle,
            jobs,
            [*warm, *pods.get("items", [])],
            events.get("items", []),
            self.settings.kube_job_ttl_seconds,
        )
        # A Pod per episode: the report's run_isolation (a host run says "host").
        facts = {"isolation": "pod"}
        return FinishedRun(records=records, completed_at=completed_at, verdict=verdict, facts=facts)

    def cancel_run(self, handle: RunHandle) -> None:
        """Suspend the Jobs: their controller deletes the running Pods and starts no more, and
        the Jobs stay (with their records) until the run is deleted. Warm Pods get a deadline
        that has passed: the kubelet stops them, and they stay as records too. A fed run's
        Pods are found by its label too (the feeder may have claimed one since the receipt
        was read)."""
        handle = handle_as(KubeRunHandle, handle)
        stop = {claim.pod: claim.uid for claim in handle.warm}
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
        handle = handle_as(KubeRunHandle, handle)
        namespace = _namespace(handle)
        warm_gone = (
            self.pools.delete_claimed(handle.pool_namespace, handle.batch_id, handle.warm)
            if handle.warm and handle.pool_namespace
            else True
        )
        gone = delete_batch_namespace(self._call, self.core, self.batch, handle, namespace)
        return gone and warm_gone

    # -- warm pools (backends/warm.py, kube/pools.py, kube/feed.py) -----------------------------
    def pool_key(self, spec: BatchSpec) -> str | None:
        # A warm Pod is one container: a batch that grades in a second one starts cold; one
        # whose runner grades in its agent's container (stashes_tests) takes warm Pods, its
        # hidden tests handed over apart from the task. Env tables start cold (task_env).
        if grades_apart(spec) or task_env.has_env(spec.tasks):
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

    def feed_run(
        self,
        spec: BatchSpec,
        handle: RunHandle,
        record: ReceiptUpdate,
        *,
        timeout: float,
        budget: int,
        idle_seconds: float,
    ) -> Fed:
        handle = handle_as(KubeRunHandle, handle)
        key = self.pool_key(spec)
        if key is None or not handle.fed or handle.pool_namespace is None:
            return Fed(list(handle.warm), done=True)
        return feed(
            self.pools,
            self._pool_watch(key),
            spec,
            key,
            handle.pool_namespace,
            handle.warm,
            record,
            timeout=timeout,
            budget=budget,
            idle_seconds=idle_seconds,
        )

    def list_pools(self) -> dict[str, dict[str, Any]]:
        return self.pools.list_all()

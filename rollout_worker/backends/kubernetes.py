"""The Kubernetes backend: one namespace and one Indexed Job per batch.

I/O only; objects come from `manifests` (pure). Every API error is translated at this edge into
our errors (404 -> ResourceNotFound, 409 -> ResourceConflict, 429/5xx/connection ->
TransientBackendError). Responses are read as JSON dicts (no model deserialisation): faster
at 1000 Pods, and exactly what kubectl would save as records.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import time
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

import orjson
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from rollout_worker import constants as k
from rollout_worker.backends.base import ReceiptUpdate, RunHandle
from rollout_worker.errors import (
    BackendError,
    BackendUnavailable,
    CapacityError,
    OwnershipError,
    ResourceConflict,
    ResourceNotFound,
    TransientBackendError,
)
from rollout_worker.manifests import (
    CONTAINER_NAME,
    INDEX_LABEL,
    JOB_NAME,
    configmap_manifest,
    job_manifest,
    namespace_manifest,
    namespace_name,
    network_policy_manifest,
)
from rollout_worker.models import BatchSpec, EpisodeObservation
from rollout_worker.quantities import format_memory, parse_quantity
from rollout_worker.sandbox import episode_program_text
from rollout_worker.settings import Settings

MAX_LOG_BYTES = 8 * 2**20
DELETE_WAIT_SECONDS = 120.0
JOB_SETTLE_SECONDS = 15
REQUEST_TIMEOUT = 30


def _ts(value: str | None) -> float | None:
    """RFC 3339 (second resolution in Kubernetes) -> unix seconds."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


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
    cfg.connection_pool_maxsize = 32  # collectors run many threads per process
    return client.ApiClient(cfg), context


def _tolerates(tolerations: Iterable[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists":
            if not tol.get("key") or tol["key"] == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and tol.get("value", "") == taint.get("value", ""):
            return True
    return False


def capacity_plan(
    spec: BatchSpec,
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    overhead: dict[str, str],
    runtime_scheduling: dict[str, Any],
) -> tuple[int, str]:
    """How many sandboxes of this spec fit on the schedulable nodes, and the arithmetic."""
    cpu = parse_quantity(spec.resources.cpu_request) + parse_quantity(overhead.get("cpu", "0"))
    mem = parse_quantity(spec.resources.memory_request) + parse_quantity(
        overhead.get("memory", "0")
    )
    selector = {**spec.node_selector, **(runtime_scheduling.get("nodeSelector") or {})}
    tolerations = [*spec.tolerations, *(runtime_scheduling.get("tolerations") or [])]
    used: dict[str, list[Decimal]] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if not node:
            continue
        slot = used.setdefault(node, [Decimal(0), Decimal(0), Decimal(0)])
        slot[2] += 1
        for container in pod["spec"].get("containers", []):
            requests = (container.get("resources") or {}).get("requests") or {}
            slot[0] += parse_quantity(requests.get("cpu", "0"))
            slot[1] += parse_quantity(requests.get("memory", "0"))
        for name, value in ((pod["spec"].get("overhead")) or {}).items():
            if name == "cpu":
                slot[0] += parse_quantity(value)
            elif name == "memory":
                slot[1] += parse_quantity(value)
    fits_total, lines = 0, []
    for node in nodes:
        meta, node_spec = node["metadata"], node.get("spec", {})
        name = meta["name"]
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in node.get("status", {}).get("conditions", [])
        )
        labels = meta.get("labels") or {}
        blocking = [
            t
            for t in node_spec.get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, t)
        ]
        if (
            not ready
            or node_spec.get("unschedulable")
            or blocking
            or any(labels.get(key) != value for key, value in selector.items())
        ):
            continue
        alloc = node.get("status", {}).get("allocatable", {})
        use = used.get(name, [Decimal(0), Decimal(0), Decimal(0)])
        free_cpu = parse_quantity(alloc.get("cpu", "0")) - use[0]
        free_mem = parse_quantity(alloc.get("memory", "0")) - use[1]
        free_pods = int(parse_quantity(alloc.get("pods", "110"))) - int(use[2])
        fits = max(
            0,
            min(
                int(free_cpu / cpu) if cpu else free_pods,
                int(free_mem // mem) if mem else free_pods,
                free_pods,
            ),
        )
        fits_total += fits
        lines.append(
            f"{name}: free cpu {free_cpu:g}, memory {format_memory(int(free_mem))}, "
            f"pods {free_pods} -> {fits}"
        )
    per_pod = (
        f"(cpu {spec.resources.cpu_request} + overhead {overhead.get('cpu', '0')}, "
        f"memory {spec.resources.memory_request} + overhead "
        f"{overhead.get('memory', '0')} = {format_memory(int(mem))})"
    )
    text = (
        f"parallelism {spec.parallelism} x {per_pod} = cpu {cpu * spec.parallelism:g}, "
        f"memory {format_memory(int(mem * spec.parallelism))}; {len(lines)} schedulable node(s) "
        f"fit {fits_total} sandbox(es)" + "".join(f"\n  {line}" for line in lines)
    )
    return fits_total, text


def observe_pods(
    handle: RunHandle, index: int, pods: dict[str, dict[str, Any]]
) -> EpisodeObservation:
    """What the Pods of one completion index say about its episode (the newest Pod counts;
    earlier ones are restarts)."""
    if not pods:
        return EpisodeObservation(
            index=index, episode_id=f"{handle['job_name']}-{index}", phase="Pending"
        )
    ordered = sorted(pods.values(), key=lambda p: p["metadata"]["creationTimestamp"])
    pod = ordered[-1]
    meta, status = pod["metadata"], pod.get("status", {})
    container: dict[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == CONTAINER_NAME),
        {},
    )
    state = container.get("state") or {}
    terminated = (
        state.get("terminated") or (container.get("lastState") or {}).get("terminated") or {}
    )
    running = state.get("running") or {}
    conditions = {
        c["type"]: _ts(c.get("lastTransitionTime")) for c in status.get("conditions") or []
    }
    created = _ts(meta["creationTimestamp"])
    scheduled = conditions.get("PodScheduled")
    started = _ts(terminated.get("startedAt") or running.get("startedAt"))
    finished = _ts(terminated.get("finishedAt"))
    phase = status.get("phase", "Pending")
    if meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
        phase = "Running"  # terminating: wait for its final state
    return EpisodeObservation(
        index=index,
        episode_id=meta["name"],
        phase=phase,
        created_at=created,
        started_at=started,
        finished_at=finished,
        node=pod.get("spec", {}).get("nodeName"),
        image_id=container.get("imageID") or None,
        exit_code=terminated.get("exitCode"),
        restart_count=int(container.get("restartCount", 0)) + len(ordered) - 1,
        reason=terminated.get("reason") or status.get("reason"),
        termination_message=terminated.get("message") or None,
        timing={
            "scheduled_at": scheduled,
            "initialized_at": conditions.get("Initialized"),
            "containers_ready_at": conditions.get("ContainersReady"),
            "container_started_at": started,
            "container_finished_at": finished,
            "scheduling_seconds": _diff(scheduled, created),
            "container_start_seconds": _diff(started, scheduled),
        },
    )


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.api, self.context = _api_client(settings)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.nodes_api = client.NodeV1Api(self.api)
        self.net = client.NetworkingV1Api(self.api)

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
        ready = [
            n["metadata"]["name"]
            for n in nodes
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in n.get("status", {}).get("conditions", [])
            )
        ]
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
        ns = self._create_or_adopt(
            spec,
            "namespace",
            namespace_manifest(spec),
            self.core.create_namespace,
            self.core.read_namespace,
            namespace,
        )
        record({"uid": ns["metadata"]["uid"]})
        self._create_or_adopt(
            spec,
            "configmap",
            configmap_manifest(spec, episode_program_text()),
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
        job = self._create_or_adopt(
            spec,
            "job",
            job_manifest(spec, ttl_seconds_after_finished=self.settings.kube_job_ttl_seconds),
            self.batch.create_namespaced_job,
            self.batch.read_namespaced_job,
            JOB_NAME,
            namespace,
        )
        record({"job_uid": job["metadata"]["uid"]})
        return {
            "backend": self.name,
            "batch_id": spec.batch_id,
            "context": self.context,
            "namespace": namespace,
            "namespace_uid": ns["metadata"]["uid"],
            "job_name": JOB_NAME,
            "job_uid": job["metadata"]["uid"],
            "origin": _ts(job["metadata"]["creationTimestamp"]),
        }

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
        if (
            labels.get(k.LABEL_OWNER) != k.LABEL_OWNER_VALUE
            or labels.get(k.LABEL_BATCH) != spec.batch_id
        ):
            raise OwnershipError(
                f"{kind} {'/'.join(read_args)} exists but is not ours "
                f"(labels {labels}); refusing to use it"
            )
        return existing

    def episode_id(self, handle: RunHandle, index: int) -> str:
        return f"{handle['job_name']}-{index}"  # Pod names add a random suffix once created

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
        stream = watch.Watch()
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

    def wait_episode(self, handle: RunHandle, index: int, timeout: float) -> EpisodeObservation:
        selector = f"{k.LABEL_BATCH}={handle['batch_id']},{INDEX_LABEL}={index}"
        pods = self._follow(
            "pods",
            self.core.list_namespaced_pod,
            handle["namespace"],
            lambda seen: observe_pods(handle, index, seen).terminal,
            timeout,
            label_selector=selector,
        )
        obs = observe_pods(handle, index, pods)
        if not obs.terminal and not pods:
            obs = self._ended_without_pod(handle, index, obs)
        return obs

    def _ended_without_pod(
        self, handle: RunHandle, index: int, obs: EpisodeObservation
    ) -> EpisodeObservation:
        """No Pod for this index: if the Job has ended, the episode ended with it."""
        job = self._call(
            "read job", self.batch.read_namespaced_job, handle["job_name"], handle["namespace"]
        )
        _, verdict = _job_verdict(job)
        if verdict != "Running":
            reasons = [
                c.get("reason")
                for c in (job.get("status") or {}).get("conditions") or []
                if c.get("type") == verdict
            ]
            obs.phase = "Failed"
            obs.reason = f"Job {verdict}: {reasons[0] if reasons else '?'} (no Pod ran)"
        return obs

    def read_output(self, handle: RunHandle, obs: EpisodeObservation) -> str:
        try:
            return self._text(
                f"log of {obs.episode_id}",
                self.core.read_namespaced_pod_log,
                obs.episode_id,
                handle["namespace"],
                container=CONTAINER_NAME,
                limit_bytes=MAX_LOG_BYTES,
            )
        except (ResourceNotFound, BackendError) as exc:
            if isinstance(exc, TransientBackendError):
                raise
            return ""  # validation reports the missing events (and any termination message)

    def _settled_job(self, handle: RunHandle) -> dict[str, Any]:
        """The Job once its controller has marked it Complete or Failed (it does so shortly
        after the last Pod ends), or as it is after JOB_SETTLE_SECONDS."""
        namespace, name = handle["namespace"], handle["job_name"]
        try:
            jobs = self._follow(
                "jobs",
                self.batch.list_namespaced_job,
                namespace,
                lambda seen: any(_job_verdict(j)[1] != "Running" for j in seen.values()),
                JOB_SETTLE_SECONDS,
                field_selector=f"metadata.name={name}",
            )
        except BackendError:
            jobs = {}  # the records then show the Job as it is now
        if jobs:
            return next(iter(jobs.values()))
        return self._call("read job", self.batch.read_namespaced_job, name, namespace)

    def finish_run(self, spec: BatchSpec, handle: RunHandle) -> dict[str, Any]:
        namespace = handle["namespace"]
        job = self._settled_job(handle)
        pods = self._call(
            "list pods",
            self.core.list_namespaced_pod,
            namespace,
            label_selector=f"{k.LABEL_BATCH}={handle['batch_id']}",
        )
        events = self._call("list events", self.core.list_namespaced_event, namespace)
        completed_at, verdict = _job_verdict(job)
        submitted = job_manifest(
            spec, ttl_seconds_after_finished=self.settings.kube_job_ttl_seconds
        )
        records = {
            "job.json": _pretty(job),
            "pods.json": _pretty(pods.get("items", [])),
            "events.txt": _events_text(events.get("items", [])),
            "job-submitted.json": _pretty(submitted),
        }
        facts = {
            "completed_at": completed_at,
            "job_status": verdict,
            "context": handle["context"],
            "namespace": namespace,
        }
        return {"records": records, "facts": facts}

    def delete_run(self, handle: RunHandle) -> None:
        namespace = handle["namespace"]
        try:
            ns = self._call("read namespace", self.core.read_namespace, namespace)
        except ResourceNotFound:
            return  # already absent
        labels = ns["metadata"].get("labels") or {}
        if (
            ns["metadata"]["uid"] != handle.get("namespace_uid")
            or labels.get(k.LABEL_OWNER) != k.LABEL_OWNER_VALUE
            or labels.get(k.LABEL_BATCH) != handle.get("batch_id")
        ):
            raise OwnershipError(
                f"namespace {namespace} has uid {ns['metadata']['uid']} and labels {labels}; "
                f"the receipt says uid {handle.get('namespace_uid')} and batch "
                f"{handle.get('batch_id')}: refusing to delete what we cannot prove we created"
            )
        try:
            job = self._call(
                "read job", self.batch.read_namespaced_job, handle["job_name"], namespace
            )
        except ResourceNotFound:
            job = None
        if job is not None:
            if job["metadata"]["uid"] != handle.get("job_uid"):
                raise OwnershipError(
                    f"Job {namespace}/{handle['job_name']} has uid "
                    f"{job['metadata']['uid']}, the receipt says "
                    f"{handle.get('job_uid')}: refusing to delete it"
                )
            self._delete(
                "job",
                self.batch.delete_namespaced_job,
                handle["job_name"],
                namespace,
                uid=job["metadata"]["uid"],
            )
            self._wait_gone(
                "Job and its Pods", self.batch.read_namespaced_job, handle["job_name"], namespace
            )
        self._delete("namespace", self.core.delete_namespace, namespace, uid=ns["metadata"]["uid"])
        self._wait_gone("namespace", self.core.read_namespace, namespace)

    def _delete(self, what: str, fn: Callable[..., Any], *args: str, uid: str) -> None:
        # Preconditions make the server refuse if the object was replaced since we checked.
        body = {"propagationPolicy": "Foreground", "preconditions": {"uid": uid}}
        with contextlib.suppress(ResourceNotFound):
            self._call(f"delete {what}", fn, *args, body=body)

    def _wait_gone(self, what: str, read: Callable[..., Any], *args: str) -> None:
        deadline = time.monotonic() + DELETE_WAIT_SECONDS
        while True:
            try:
                self._call(f"read {what}", read, *args)
            except ResourceNotFound:
                return
            if time.monotonic() > deadline:
                raise BackendError(
                    f"{what} {'/'.join(args)} still terminating after "
                    f"{DELETE_WAIT_SECONDS:.0f}s; inspect its finalizers "
                    "(never force-removed)"
                )
            time.sleep(1)


def _job_verdict(job: dict[str, Any]) -> tuple[float | None, str]:
    """(when, "Complete" | "Failed") once the Job has finished, else (None, "Running")."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return _ts(condition.get("lastTransitionTime")), condition["type"]
    return None, "Running"


def _pretty(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n"


def _events_text(events: list[dict[str, Any]]) -> str:
    def when(event: dict[str, Any]) -> str:
        return (
            event.get("lastTimestamp")
            or event.get("eventTime")
            or event["metadata"].get("creationTimestamp")
            or ""
        )

    lines = ["TIME\tTYPE\tREASON\tOBJECT\tMESSAGE"]
    for event in sorted(events, key=when):
        obj = event.get("involvedObject") or {}
        lines.append(
            "\t".join(
                [
                    when(event),
                    event.get("type", ""),
                    event.get("reason", ""),
                    f"{obj.get('kind', '')}/{obj.get('name', '')}",
                    (event.get("message") or "").replace("\n", " "),
                ]
            )
        )
    return "\n".join(lines) + "\n"

"""Pure reading of Kubernetes API objects (as JSON dicts): capacity arithmetic, what a Pod says
about its episode, how a Job ended, records as text. No I/O: unit-tested without a cluster."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson

from rollout_wire import constants as k
from rollout_wire.request import BatchSpec
from rollout_worker.backends.base import KubeRunHandle, RunHandle
from rollout_worker.backends.kube.objects import (
    FIRST_INDEX_LABEL,
    INDEX_LABEL,
    JOB_NAME,
    POOL_STATE_IDLE,
    job_manifest,
    job_parts,
)
from rollout_worker.backends.kube.pod_spec import AGENT_CONTAINER, CONTAINER_NAME, SEED_CONTAINER
from rollout_worker.observation import (
    EXIT_INFRASTRUCTURE,
    EpisodeObservation,
    attempt_summary,
    own_disk_eviction,
)
from rollout_worker.quantities import format_memory, parse_quantity


def ts(value: str | None) -> float | None:
    """RFC 3339 (second resolution in Kubernetes) -> unix seconds."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _diff(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def tolerates(tolerations: Iterable[dict[str, Any]], taint: dict[str, Any]) -> bool:
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
            if t.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, t)
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


# Set by the shared Pod watch on the last state of a Pod the API server deleted.
DELETED_MARK = "rolloutDeleted"

# Container waiting reasons that no retry fixes: the episode fails now, not at its deadline.
NEVER_STARTS = frozenset({"ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError"})


# The reason of an episode whose attempt failed within the retry budget: the Job controller
# runs it again in a new Pod, so it has not ended.
RETRYING = "retrying"


def episode_ended(handle: KubeRunHandle, index: int, pods: Mapping[str, dict[str, Any]]) -> bool:
    """What the watch shows of episode `index` is its end."""
    if handle.warm_pod(index) is not None and not pods:
        return True  # claimed before the run existed, so a synced watch has it: gone
    return observe_pods(handle, index, pods, final=handle.in_pool(index)).terminal


def retryable(pod: Mapping[str, Any], obs: EpisodeObservation) -> bool:
    """Whether a failed Pod uses up its episode's retry budget instead of ending the episode:
    the runner's infrastructure exit code, or a disruption (eviction, preemption, node loss).
    The Job's podFailurePolicy (objects.pod_failure_policy) says the same."""
    if obs.phase != "Failed":
        return False
    disrupted = any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )
    return disrupted or obs.exit_code == EXIT_INFRASTRUCTURE


def observe_pods(
    handle: RunHandle, index: int, pods: Mapping[str, dict[str, Any]], *, final: bool = False
) -> EpisodeObservation:
    """What the Pods of one completion index say about its episode.

    The newest Pod is the episode's current attempt. Earlier Pods that failed retryably, up to
    the batch's budget (`handle.infra_retries`), are its retried attempts; any other earlier
    Pod is a restart. A newest Pod that failed retryably with budget left has not ended the
    episode (phase Pending, reason RETRYING: the Job controller replaces it) unless `final`
    (the Job will not: it ended, or counted the index failed)."""
    if not pods:
        return EpisodeObservation(index=index, episode_id=handle.episode_id(index), phase="Pending")
    ordered = sorted(pods.values(), key=lambda p: p["metadata"]["creationTimestamp"])
    obs = _observe_pod(index, ordered[-1])
    for pod in ordered[:-1]:
        earlier = _observe_pod(index, pod)
        if len(obs.retried) < handle.infra_retries and retryable(pod, earlier):
            obs.retried.append(attempt_summary(earlier))
        else:
            obs.restart_count += 1
    if (
        not final
        and len(obs.retried) < handle.infra_retries
        and not ordered[-1].get(DELETED_MARK)
        and retryable(ordered[-1], obs)
    ):
        obs.phase = "Pending"
        obs.reason = f"{RETRYING}: {attempt_summary(obs)['cause']}"
    return obs


def _observe_pod(index: int, pod: dict[str, Any]) -> EpisodeObservation:
    """One Pod of an episode, on its own."""
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
    terminated, agent_started, log_containers = _init_containers(status, terminated, running)
    conditions = {
        c["type"]: ts(c.get("lastTransitionTime")) for c in status.get("conditions") or []
    }
    created = ts(meta["creationTimestamp"])
    claimed = (meta.get("annotations") or {}).get(k.ANNOTATION_CLAIMED_AT)
    pool_created = None
    if claimed is not None:
        # A warm Pod became this episode's sandbox when a batch claimed it: that is its
        # "sandbox created" (the claim is after the run's origin; the Pod itself is older).
        pool_created, created = created, float(claimed)
    scheduled = conditions.get("PodScheduled")
    started = ts(agent_started or terminated.get("startedAt") or running.get("startedAt"))
    finished = ts(terminated.get("finishedAt"))
    phase, reason = _pod_phase(pod, state, terminated)
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
        restart_count=int(container.get("restartCount", 0)),
        reason=reason,
        termination_message=terminated.get("message") or None,
        log_containers=log_containers,
        # A warm Pod has no ready probe (it started long before its episode): no signal.
        ready=phase == "Running" and container.get("started") is True and claimed is None,
        timing={
            "scheduled_at": scheduled,
            "initialized_at": conditions.get("Initialized"),
            "containers_ready_at": conditions.get("ContainersReady"),
            "container_started_at": started,
            "container_finished_at": finished,
            "scheduling_seconds": _diff(scheduled, pool_created or created),
            "container_start_seconds": _diff(started, scheduled),
            **({"pool_created_at": pool_created} if pool_created is not None else {}),
        },
    )


def _init_containers(
    status: dict[str, Any], terminated: dict[str, Any], running: dict[str, Any]
) -> tuple[dict[str, Any], str | None, list[str]]:
    """What a Pod graded apart adds: (how the episode ended, when its agent's init container
    started, the containers whose logs make the episode's log)."""
    statuses = status.get("initContainerStatuses") or []
    agent = next((s for s in statuses if s.get("name") == AGENT_CONTAINER), None)
    if agent is None:
        return terminated, None, []
    # Graded apart: the agent's init container ran first, so the sandbox started with it;
    # an init container that failed is the episode's end (the later ones never run). With
    # steps (pod_steps.py) every step's agent and grader before the Pod's container.
    logs = [s["name"] for s in statuses if s.get("name") != SEED_CONTAINER] + [CONTAINER_NAME]
    agent_state = agent.get("state") or {}
    for init in statuses if not terminated and not running else []:
        ended = (init.get("state") or {}).get("terminated") or {}
        if ended.get("exitCode") not in (None, 0):
            terminated = ended
            if init.get("name") == SEED_CONTAINER:
                # The workspace's seed failed (the image has no such workdir): neither the
                # agent nor the grader ran, and its log (read only then) says why.
                logs = [SEED_CONTAINER, *logs]
            break
    ended = agent_state.get("terminated") or {}
    return terminated, (agent_state.get("running") or ended).get("startedAt"), logs


def _init_never_starts(status: dict[str, Any]) -> dict[str, Any] | None:
    """The waiting state of an init container that can never start (graded apart, the agent's
    init container runs first: without this its missing image held the episode to its
    deadline, as a CI run whose images the kubelet had deleted showed)."""
    for init in status.get("initContainerStatuses") or []:
        waiting = (init.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in NEVER_STARTS:
            return waiting
    return None


def _pod_phase(
    pod: dict[str, Any], state: dict[str, Any], terminated: dict[str, Any]
) -> tuple[str, str | None]:
    """The episode's phase and reason from one Pod: its phase, or what its container's end,
    a container that can never start, or its deletion already decided."""
    meta, status = pod["metadata"], pod.get("status", {})
    phase = status.get("phase", "Pending")
    # A Pod-level reason (DeadlineExceeded, Evicted) says more than the container's ("Error"
    # after the kill that enforced it).
    reason = status.get("reason") or terminated.get("reason")
    # Evicted for the episode's own disk use (its limit, not the node's pressure): its doing.
    reason = own_disk_eviction(status) or reason
    waiting = state.get("waiting") or {}
    if waiting.get("reason") not in NEVER_STARTS:
        waiting = _init_never_starts(status) or waiting
    if (
        phase in ("Pending", "Running")
        and state.get("terminated")
        and (pod.get("spec") or {}).get("restartPolicy") == "Never"
        and len(status.get("containerStatuses") or []) == 1
        and not meta.get("deletionTimestamp")
    ):
        # The one container exited and can never run again: the episode has ended. The kubelet
        # reports the container's end (exit code, termination message) about a second before
        # the Pod's phase, which it holds until the sandbox is torn down (seen on 1.34; a short
        # container the kubelet never saw running is still Pending then).
        phase = "Succeeded" if state["terminated"].get("exitCode") == 0 else "Failed"
    elif phase == "Pending" and waiting.get("reason") in NEVER_STARTS:
        # The container can never start: the episode has ended, whatever the Pod waits for.
        phase = "Failed"
        reason = f"{waiting['reason']}: {waiting.get('message') or ''}".strip(": ")
    if pod.get(DELETED_MARK) and phase not in ("Succeeded", "Failed"):
        # Gone from the API before it reached a final phase: that is how the episode ended.
        phase = "Failed"
        reason = f"{reason or 'Deleted'}; the Pod was deleted before it ended"
    elif meta.get("deletionTimestamp"):
        if phase not in ("Succeeded", "Failed"):
            phase = "Running"  # terminating: wait for its final state
        else:
            reason = f"{reason or phase}; the Pod was deleted before it ended"
    return phase, reason


def pretty_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n"


def events_text(events: list[dict[str, Any]]) -> str:
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


def run_records(
    spec: BatchSpec,
    handle: KubeRunHandle,
    jobs: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    events: list[dict[str, Any]],
    ttl_seconds: int,
) -> dict[str, str]:
    """A finished run's records: its Pods (`pods`: warm ones first), its events, and each
    Job as it ended and as it was submitted. The guide's job.json and job-submitted.json are
    the first Job's; a batch of several images (or warm episodes between cold ones) adds
    job-<name>.json and job-<name>-submitted.json for the others."""
    records = {"pods.json": pretty_json(pods), "events.txt": events_text(events)}
    in_pool = set(range(spec.count)) if handle.fed else {claim.index for claim in handle.warm}
    for part in job_parts(spec, in_pool):
        name = "job" if part.name == JOB_NAME else f"job-{part.name}"
        job = next((j for j in jobs if j["metadata"]["name"] == part.name), None)
        if job is not None:
            records[f"{name}.json"] = pretty_json(job)
        submitted = job_manifest(spec, ttl_seconds_after_finished=ttl_seconds, part=part)
        records[f"{name}-submitted.json"] = pretty_json(submitted)
    return records


def completion_index(pod: Mapping[str, Any]) -> int | None:
    """The episode index of a batch Pod: its Job's first index + its completion index, or the
    index its claim gave a warm Pod."""
    labels = pod.get("metadata", {}).get("labels") or {}
    value = labels.get(INDEX_LABEL)
    try:
        if k.LABEL_EPISODE_INDEX in labels:
            return int(labels[k.LABEL_EPISODE_INDEX])
        return int(value) + int(labels.get(FIRST_INDEX_LABEL, 0)) if value is not None else None
    except ValueError:
        return None


def node_ready(node: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in node.get("status", {}).get("conditions", [])
    )


def labelled_ours(obj: dict[str, Any], batch_id: str) -> bool:
    """Whether an object carries our owner label and this batch's label."""
    labels = obj["metadata"].get("labels") or {}
    return bool(
        labels.get(k.LABEL_OWNER) == k.LABEL_OWNER_VALUE and labels.get(k.LABEL_BATCH) == batch_id
    )


def handle_from_receipt(receipt: Mapping[str, Any]) -> KubeRunHandle | None:
    """The run handle of a run cut short before its handle was recorded: the receipt's first
    fields (context, namespace, then its UID and the Job's) still prove what was created."""
    if not receipt.get("namespace") or not receipt.get("uid"):
        return None
    return KubeRunHandle(
        backend="kubernetes",
        batch_id=str(receipt.get("run_id") or receipt.get("batch_id")),
        origin=0.0,
        episode_prefix=JOB_NAME,
        context=str(receipt.get("context")),
        namespace=str(receipt["namespace"]),
        namespace_uid=str(receipt["uid"]),
        job_name=JOB_NAME,
        job_uid=receipt.get("job_uid"),
    )


def pool_pod_waiting(pod: dict[str, Any]) -> bool:
    """An idle pool Pod whose program runs (and so reads its stdin)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    if (meta.get("labels") or {}).get(k.LABEL_POOL_STATE) != POOL_STATE_IDLE:
        return False
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or [])


def pool_pod_started_at(pod: dict[str, Any]) -> float | None:
    """When a pool Pod started (its deadline counts from then)."""
    return ts((pod.get("status") or {}).get("startTime"))


def pool_pod_ended(pod: Mapping[str, Any]) -> bool:
    """A pool Pod whose container ended (or that is gone, or going): its slot is free."""
    meta, status = pod["metadata"], pod.get("status") or {}
    if pod.get(DELETED_MARK) or meta.get("deletionTimestamp"):
        return True
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    return any(
        "terminated" in (c.get("state") or {}) for c in status.get("containerStatuses") or []
    )


@dataclass(frozen=True)
class FeedPlan:
    """What the feeder does next with a fed run's pool (`feed_plan`)."""

    # Episode index -> the waiting Pod to claim for it (lowest indexes first, oldest Pods).
    claims: list[tuple[int, dict[str, Any]]]
    # Pods labelled with this batch that the claims list does not hold yet (a look that
    # died between its claim and its record): [index, name, UID].
    found: list[list[Any]]
    # Idle Pods (waiting or starting) the pool should hold for the episodes not claimed yet.
    idle_wanted: int
    idle_have: int
    done: bool  # every episode is claimed


def feed_plan(
    pods: Iterable[Mapping[str, Any]],
    batch_id: str,
    parallelism: int,
    count: int,
    claims: Iterable[list[Any]],
    ahead: int | None = None,
) -> FeedPlan:
    """The feeder's plan from one snapshot of the pool's Pods: a slot is a claimed Pod of the
    batch whose container has not ended; each free slot gets the next unclaimed episode and
    the oldest waiting Pod; the pool is kept `ahead` idle Pods ahead (default one wave,
    `parallelism`; fewer near the batch's end)."""
    pods = list(pods)
    claimed = {int(c[0]) for c in claims}
    ours = [p for p in pods if (p["metadata"].get("labels") or {}).get(k.LABEL_BATCH) == batch_id]
    found = []
    for pod in ours:
        index = int(pod["metadata"]["labels"][k.LABEL_EPISODE_INDEX])
        if index not in claimed:
            claimed.add(index)
            found.append([index, pod["metadata"]["name"], pod["metadata"]["uid"]])
    busy = sum(1 for p in ours if not pool_pod_ended(p))
    unclaimed = [i for i in range(count) if i not in claimed]
    waiting = sorted(
        (p for p in pods if pool_pod_waiting(dict(p)) and not p.get(DELETED_MARK)),
        key=lambda p: p["metadata"]["creationTimestamp"],
    )
    pairs = list(zip(unclaimed[: max(0, parallelism - busy)], waiting, strict=False))
    idle = [
        p
        for p in pods
        if (p["metadata"].get("labels") or {}).get(k.LABEL_POOL_STATE) == POOL_STATE_IDLE
        and not pool_pod_ended(p)
    ]
    left = len(unclaimed) - len(pairs)
    return FeedPlan(
        claims=[(i, dict(p)) for i, p in pairs],
        found=found,
        idle_wanted=min(parallelism if ahead is None else ahead, left),
        idle_have=len(idle) - len(pairs),
        done=not unclaimed,
    )

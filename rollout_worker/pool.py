"""Warm pools, pure: which batches can share a pool, a pool's objects, how a pool Pod is claimed
and the line that makes it an episode. The API calls live in `backends/kube_pool.py`.

A pool is one namespace per sandbox shape (image, RuntimeClass, resources, placement, policy
endpoint and episode program). Its Pods run the episode program up to the point where it needs
its episode (interpreter started, imports done) and wait on stdin. A batch claims one by a label
patch that only succeeds on the version it read (two batches never get the same Pod), then
writes the episode's variables to its stdin through the API server's attach: the sandbox's
network stays as closed as a cold one's. A pool Pod runs one episode and is never reused.

Why per policy endpoint: a NetworkPolicy is applied when a Pod starts on some CNIs (this
project's local node among them), so a Pod's egress must be right before it waits.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import orjson

from rollout_wire import constants as k
from rollout_wire.request import BatchSpec
from rollout_wire.tasksets import demo_task
from rollout_worker.manifests import (
    CONFIGMAP_NAME,
    PROGRAM_KEY,
    job_parts,
    network_policy_manifest,
    policy_endpoint,
    sandbox_pod_spec,
)

NAMESPACE_PREFIX = "rollout-pool-"
POD_PREFIX = "warm-"
STATE_IDLE = "idle"
STATE_CLAIMED = "claimed"
# Where the hand-over writes a real rollout's task (the Pod's own /tmp, memory-backed).
TASKS_FILE = "/tmp/rollout-tasks.json"
# A pool Pod lives at most this long past the pool's idle time: a backstop for a pool nobody
# drains (its Pods then end DeadlineExceeded without an episode).
LIFETIME_EXTRA_SECONDS = 3600
# A claimed Pod must have this much of its lifetime left beyond the episode's own timeout.
CLAIM_MARGIN_SECONDS = 5


def pool_image(spec: BatchSpec) -> str | None:
    """The one image of a batch's episodes, or None when they use several."""
    images = {part.image for part in job_parts(spec)}
    return images.pop() if len(images) == 1 else None


def pool_key(spec: BatchSpec, program: str) -> str | None:
    """Which pool a batch takes from, or None when it can take none: its episodes use several
    images, or it has a retry budget (a warm episode has no Job to run it again)."""
    image = pool_image(spec)
    if image is None or spec.infra_retries:
        return None
    shape = {
        "image": image,
        "runtime": spec.runtime,
        "image_pull_policy": spec.image_pull_policy,
        "resources": asdict(spec.resources),
        "node_selector": spec.node_selector,
        "tolerations": spec.tolerations,
        "policy": policy_endpoint(spec.policy["url"]) if spec.policy else None,
        "program": hashlib.sha256(program.encode()).hexdigest(),
    }
    return hashlib.sha256(orjson.dumps(shape, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def pool_namespace(key: str) -> str:
    return f"{NAMESPACE_PREFIX}{key}"


def pool_labels(key: str) -> dict[str, str]:
    return {k.LABEL_OWNER: k.LABEL_OWNER_VALUE, k.LABEL_POOL: key}


def namespace_manifest(key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": pool_namespace(key), "labels": pool_labels(key)},
    }


def configmap_manifest(key: str, program: str) -> dict[str, Any]:
    """The episode program (a pool's episodes bring their task in the hand-over)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": CONFIGMAP_NAME,
            "namespace": pool_namespace(key),
            "labels": pool_labels(key),
        },
        "data": {PROGRAM_KEY: program},
    }


def network_policy(spec: BatchSpec, key: str) -> dict[str, Any]:
    """The same deny-all (plus the policy endpoint) as the batch's own namespace."""
    return network_policy_manifest(spec, pool_namespace(key), pool_labels(key))


def lifetime_seconds(spec: BatchSpec, idle_seconds: float) -> int:
    return math.ceil(idle_seconds) + LIFETIME_EXTRA_SECONDS + spec.episode_timeout_seconds


def pod_manifest(spec: BatchSpec, key: str, idle_seconds: float) -> dict[str, Any]:
    """A pool Pod: a cold sandbox's spec (same isolation), waiting on stdin for its episode.
    No startup probe: a probe execs into every waiting Pod each second."""
    image = pool_image(spec)
    if image is None:
        raise ValueError("a pool serves batches of one image")
    env = [{"name": "ROLLOUT_HANDOVER", "value": "stdin"}]
    pod_spec = sandbox_pod_spec(spec, image, env, lifetime_seconds(spec, idle_seconds))
    pod_spec["containers"][0] |= {"stdin": True, "stdinOnce": True}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": POD_PREFIX,
            "namespace": pool_namespace(key),
            "labels": pool_labels(key) | {k.LABEL_POOL_STATE: STATE_IDLE},
        },
        "spec": pod_spec,
    }


def _started_at(pod: dict[str, Any]) -> float | None:
    from rollout_worker.backends.kube_read import ts  # pure; kept local to avoid a cycle

    return ts((pod.get("status") or {}).get("startTime"))


def waiting(pod: dict[str, Any]) -> bool:
    """An idle pool Pod whose program runs (and so reads its stdin)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    if (meta.get("labels") or {}).get(k.LABEL_POOL_STATE) != STATE_IDLE:
        return False
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or [])


def claim_patch(
    pod: dict[str, Any], batch_id: str, index: int, episode_timeout: int, now: float
) -> dict[str, Any] | None:
    """The merge patch that makes a waiting Pod episode `index` of a batch, or None when the
    Pod has too little lifetime left. `resourceVersion` makes the server refuse it (409) if the
    Pod changed since it was read: another batch claimed it first.

    activeDeadlineSeconds counts from the Pod's start and may only go down: the episode gets
    its own timeout from now."""
    started = _started_at(pod)
    lifetime = (pod.get("spec") or {}).get("activeDeadlineSeconds")
    if started is None or lifetime is None:
        return None
    deadline = math.ceil(now - started) + episode_timeout
    if deadline + CLAIM_MARGIN_SECONDS > lifetime:
        return None
    return {
        "metadata": {
            "resourceVersion": pod["metadata"]["resourceVersion"],
            "labels": {
                k.LABEL_BATCH: batch_id,
                k.LABEL_POOL_STATE: STATE_CLAIMED,
                k.LABEL_EPISODE_INDEX: str(index),
            },
            "annotations": {k.ANNOTATION_CLAIMED_AT: f"{now:.6f}"},
        },
        "spec": {"activeDeadlineSeconds": deadline},
    }


def handover_line(
    spec: BatchSpec,
    index: int,
    *,
    env: Mapping[str, str] | None = None,
    policy_access: Mapping[str, str] | None = None,
) -> bytes:
    """What a claimed sandbox reads on its stdin: the variables a cold sandbox of episode
    `index` gets when it starts, and a real rollout's task (the runner's take_handover).
    `env` adds backend variables (the local backend's episode id); `policy_access` says how the
    policy is reached (default: ROLLOUT_POLICY_URL, Kubernetes)."""
    values: dict[str, str] = {"ROLLOUT_ACTION": spec.action, "ROLLOUT_BATCH_ID": spec.batch_id}
    values |= dict(env or {})
    line: dict[str, Any] = {"env": values}
    if spec.policy is not None:
        episode = spec.episode(index)
        task = spec.tasks[episode.task_index] if episode.task_index is not None else demo_task()
        values |= dict(policy_access or {"ROLLOUT_POLICY_URL": spec.policy["url"]})
        values |= {
            "ROLLOUT_POLICY": orjson.dumps(
                {name: value for name, value in spec.policy.items() if name != "url"}
            ).decode(),
            "ROLLOUT_TASKS_FILE": TASKS_FILE,
            "ROLLOUT_TASK_ID": episode.task_id,
            "ROLLOUT_SAMPLE": str(episode.sample),
            "ROLLOUT_GROUP_ID": episode.group_id,
            "ROLLOUT_ATTEMPT": "0",
        }
        line["tasks"] = [task]
    return orjson.dumps(line) + b"\n"

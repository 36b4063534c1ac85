"""Kubernetes objects of a batch, built as plain dicts. Pure: same spec in, same objects out.

One namespace per batch holds a ConfigMap with the episode program, a deny-all NetworkPolicy
and one Indexed Job per image (episode index = the Job's first index + completion index; a batch
of one image has one Job, completion index = episode index). Every object carries our owner and
batch labels; cleanup refuses anything without them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_wire import constants as k
from rollout_wire.request import BatchSpec
from rollout_wire.tasksets import demo_task
from rollout_worker.backends.kube.pod_spec import (
    AGENT_CONTAINER,
    AGENT_TASKS_KEY,
    CONFIGMAP_NAME,
    CONTAINER_NAME,
    PROGRAM_DIR,
    PROGRAM_KEY,
    SEED_CONTAINER,
    STASH_CONTAINER,
    TASKS_KEY,
    grades_apart,
    ready_probe,
    sandbox_pod_spec,
    seeds_workspace,
    stashes_tests,
    tasks_of,
)
from rollout_worker.backends.kube.pod_steps import (
    agent_tasks,
    container_names,
    step_count,
    step_data,
)
from rollout_worker.backends.kube.task_env import has_env
from rollout_worker.backends.warm import pool_image, task_image
from rollout_worker.observation import EXIT_INFRASTRUCTURE

JOB_NAME = "rollout"
# The API server refuses an object above 1 MiB (etcd's request limit is 1.5 MiB, the ConfigMap
# data limit 1 MiB); parse_spec keeps tasks below 900 KiB, this is the last check.
CONFIGMAP_MAX_BYTES = 1024 * 1024
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
FIRST_INDEX_LABEL = "rollout.dev/first-index"
# Set by the Job controller on the Pods of a Job with backoffLimitPerIndex: how many Pods of
# this index failed before this one.
FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"


def namespace_name(batch_id: str) -> str:
    return f"rollout-{batch_id}"


def owner_labels(spec: BatchSpec) -> dict[str, str]:
    return {k.LABEL_OWNER: k.LABEL_OWNER_VALUE, k.LABEL_BATCH: spec.batch_id}


def batch_selector(batch_id: str) -> str:
    """The label selector of a batch's objects (its Jobs and Pods, warm ones included)."""
    return f"{k.LABEL_BATCH}={batch_id}"


def pool_selector(key: str) -> str:
    """The label selector of one pool's Pods."""
    return f"{k.LABEL_OWNER}={k.LABEL_OWNER_VALUE},{k.LABEL_POOL}={key}"


def namespace_manifest(spec: BatchSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": namespace_name(spec.batch_id), "labels": owner_labels(spec)},
    }


def tasks_text(spec: BatchSpec) -> str | None:
    """The batch's tasks as the runner reads them (None for the demo with its fixed action)."""
    if spec.policy is None and not spec.tasks:
        return None
    return orjson.dumps(spec.tasks or [demo_task()]).decode()


def configmap_manifest(spec: BatchSpec, program: str) -> dict[str, Any]:
    data = {PROGRAM_KEY: program}
    tasks = tasks_text(spec)
    if tasks is not None:
        data[TASKS_KEY] = tasks
    images = {task_image(spec, t) for t in spec.tasks}
    if any(grades_apart(spec, i) or stashes_tests(spec, i) for i in images) or has_env(spec.tasks):
        data[AGENT_TASKS_KEY] = orjson.dumps(agent_tasks(spec.tasks)).decode()
    if step_count(spec.tasks):
        data |= step_data(spec.tasks)
    size = sum(len(key) + len(value.encode()) for key, value in data.items())
    if size > CONFIGMAP_MAX_BYTES:
        raise ValueError(
            f"the batch's ConfigMap would hold {size} bytes, above the API server's "
            f"{CONFIGMAP_MAX_BYTES}: split the task set into several batches"
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": CONFIGMAP_NAME,
            "namespace": namespace_name(spec.batch_id),
            "labels": owner_labels(spec),
        },
        "data": data,
    }


def network_policy_manifest(
    spec: BatchSpec, namespace: str | None = None, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    """Sandboxes get no network: no ingress, no egress, except (real rollouts) TCP to the
    batch's policy endpoint. Enforced where the CNI supports NetworkPolicy. Default: the
    batch's namespace; a warm pool passes its own."""
    policy_spec: dict[str, Any] = {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    if spec.policy is not None:
        policy_spec["egress"] = [
            {
                "to": [{"ipBlock": {"cidr": spec.policy.cidr}}],
                "ports": [{"protocol": "TCP", "port": spec.policy.port}],
            }
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "deny-all",
            "namespace": namespace or namespace_name(spec.batch_id),
            "labels": labels or owner_labels(spec),
        },
        "spec": policy_spec,
    }


def agent_env(spec: BatchSpec) -> list[dict[str, Any]]:
    """The agent runner's environment (none for the demo): it works out its task and sample
    from JOB_COMPLETION_INDEX, which the Job controller sets in an Indexed Job's Pods."""
    if spec.policy is None and not spec.tasks:
        return []
    values = {
        # An oracle-only batch asks no policy (and its NetworkPolicy allows no egress).
        "ROLLOUT_POLICY": spec.policy.runner_json() if spec.policy else "{}",
        **({"ROLLOUT_POLICY_URL": spec.policy.url} if spec.policy else {}),
        "ROLLOUT_TASKS_FILE": f"{PROGRAM_DIR}/{TASKS_KEY}",
        "ROLLOUT_SAMPLES_PER_TASK": str(spec.samples_per_task if spec.tasks else spec.count),
        "ROLLOUT_BATCH_ID": spec.batch_id,
    }
    return [
        *({"name": name, "value": value} for name, value in values.items()),
        # Which attempt this Pod is (0 first; the Job controller counts an index's failures).
        {
            "name": "ROLLOUT_ATTEMPT",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{FAILURE_COUNT}']"}},
        },
    ]


def pod_failure_policy(spec: BatchSpec, image: str | None = None) -> dict[str, Any]:
    """Which failed Pods use up the episode's retry budget (`backoffLimitPerIndex`): the
    runner's infrastructure exit code and disruptions (eviction, preemption, node loss). Any
    other failure (an episode error, a deadline) fails its index at once: retrying it would
    only sample the policy again until one attempt looks good. The init containers (the
    agent's when the batch grades apart, with the workspace's seed first for a task in its
    own image graded `fresh`; the tests' stash) by the same rules."""
    names = [CONTAINER_NAME]
    if seeds_workspace(spec, image):
        names = [SEED_CONTAINER, AGENT_CONTAINER, CONTAINER_NAME]
    elif grades_apart(spec, image):
        names = container_names(step_count(tasks_of(spec, image))) or [
            AGENT_CONTAINER,
            CONTAINER_NAME,
        ]
    elif stashes_tests(spec, image):
        names = [STASH_CONTAINER, CONTAINER_NAME]
    count = [
        {
            "action": "Count",
            "onExitCodes": {
                "containerName": name,
                "operator": "In",
                "values": [EXIT_INFRASTRUCTURE],
            },
        }
        for name in names
    ]
    fail = [
        {
            "action": "FailIndex",
            "onExitCodes": {
                "containerName": name,
                "operator": "NotIn",
                "values": [0, EXIT_INFRASTRUCTURE],
            },
        }
        for name in names
    ]
    return {
        "rules": [
            {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget"}]},
            *count,
            *fail,
            # Every other failed Pod (it never ran: a Pending Pod past its deadline) is not
            # retried either; without this rule the Job's default would count it.
            {"action": "FailIndex", "onPodConditions": [{"type": "Ready", "status": "False"}]},
        ]
    }


@dataclass(frozen=True)
class JobPart:
    """One Job of a batch: the episodes [first, first + count) that run one image in one
    working directory (their tasks' `workdir`; None: /workspace)."""

    name: str
    image: str
    first: int
    count: int
    parallelism: int
    workdir: str | None = None


def job_parts(spec: BatchSpec, warm: Collection[int] = ()) -> list[JobPart]:
    """One Job per image, working directory and run of cold episodes, in episode order
    (parse_spec keeps a batch's tasks grouped by image, so each image's episodes are one range
    unless their workdirs differ; the `warm` episodes, taken from a pool, cut ranges). The
    batch's parallelism is shared among them in proportion to their episodes, at least 1
    each: with more parts than `parallelism`, up to one sandbox per part runs at a time."""
    ranges: list[tuple[tuple[str, str | None], int, int]] = []
    previous: tuple[tuple[str, str | None], int] | None = None  # the last cold episode's
    for index in range(spec.count):
        if index in warm:
            continue
        episode = spec.episode(index)
        task: Mapping[str, Any] = (
            spec.tasks[episode.task_index] if episode.task_index is not None else {}
        )
        shape = (task_image(spec, task), task.get("workdir"))
        if ranges and previous == (shape, index - 1):
            ranges[-1] = (shape, ranges[-1][1], ranges[-1][2] + 1)
        else:
            ranges.append((shape, index, 1))
        previous = (shape, index)
    cold = sum(count for _, _, count in ranges)
    shares = [max(1, min(count, spec.parallelism * count // cold)) for _, _, count in ranges]
    spare = spec.parallelism - sum(shares)
    for number, (_, _, count) in enumerate(ranges):  # what rounding down left over
        extra = max(0, min(spare, count - shares[number]))
        shares[number] += extra
        spare -= extra
    return [
        JobPart(
            JOB_NAME if number == 0 else f"{JOB_NAME}-{number}",
            image,
            first,
            count,
            share,
            workdir,
        )
        for number, (((image, workdir), first, count), share) in enumerate(
            zip(ranges, shares, strict=True)
        )
    ]


def job_manifest(
    spec: BatchSpec, *, ttl_seconds_after_finished: int, part: JobPart | None = None
) -> dict[str, Any]:
    """The Job of `part` (default: the batch's first, and usually only, Job)."""
    part = part or job_parts(spec)[0]
    labels = owner_labels(spec)
    # Pods say which episodes their completion indexes count from (episode = first + index).
    pod_labels = labels | {FIRST_INDEX_LABEL: str(part.first)}
    env = [
        {"name": "ROLLOUT_ACTION", "value": spec.action},
        {"name": "ROLLOUT_INDEX_OFFSET", "value": str(part.first)},
        *agent_env(spec),
    ]
    pod_spec = sandbox_pod_spec(
        spec, part.image, env, spec.episode_timeout_seconds, workdir=part.workdir
    )
    pod_spec["containers"][0]["startupProbe"] = ready_probe(spec)
    job: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": part.name,
            "namespace": namespace_name(spec.batch_id),
            "labels": labels,
        },
        "spec": {
            "completionMode": "Indexed",
            "completions": part.count,
            "parallelism": part.parallelism,
            # One attempt per episode, like the guide's backoffLimit 0, but per index (one
            # failed episode no longer stops the others), plus the batch's retry budget for
            # infrastructure failures (podFailurePolicy says which failures those are).
            "backoffLimitPerIndex": spec.infra_retries,
            "maxFailedIndexes": part.count,
            # Set explicitly, as the ceiling per-index limits can never reach (each index fails
            # at most 1 + infra_retries times): 0 here would fail the whole Job, and stop every
            # other episode, at the first failed one (seen on 1.34). A cluster that drops the
            # per-index fields may rerun a failed episode; its collector then sees a Pod the
            # budget does not explain and reports the episode failed (restarted), never
            # counted twice.
            "backoffLimit": part.count * (spec.infra_retries + 1),
            "podReplacementPolicy": "Failed",
            "activeDeadlineSeconds": spec.deadline_seconds,
            "ttlSecondsAfterFinished": ttl_seconds_after_finished,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }
    if spec.infra_retries:
        job["spec"]["podFailurePolicy"] = pod_failure_policy(spec, part.image)
    return job


# -- warm pools: one namespace per shape (backends/warm.py), its Pods claimed one per episode --
POOL_NAMESPACE_PREFIX = "rollout-pool-"
POOL_POD_PREFIX = "warm-"
POOL_STATE_IDLE = "idle"
POOL_STATE_CLAIMED = "claimed"
# A pool Pod lives at most this long past the pool's idle time: a backstop for a pool nobody
# drains (its Pods then end DeadlineExceeded without an episode).
LIFETIME_EXTRA_SECONDS = 3600
# A claimed Pod must have this much of its lifetime left beyond the episode's own timeout.
CLAIM_MARGIN_SECONDS = 5


def pool_namespace(key: str) -> str:
    return f"{POOL_NAMESPACE_PREFIX}{key}"


def pool_labels(key: str) -> dict[str, str]:
    return {k.LABEL_OWNER: k.LABEL_OWNER_VALUE, k.LABEL_POOL: key}


def pool_namespace_manifest(key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": pool_namespace(key), "labels": pool_labels(key)},
    }


def pool_configmap_manifest(key: str, program: str) -> dict[str, Any]:
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


def pool_network_policy(spec: BatchSpec, key: str) -> dict[str, Any]:
    """The same deny-all (plus the policy endpoint) as the batch's own namespace."""
    return network_policy_manifest(spec, pool_namespace(key), pool_labels(key))


# Direct hand-over (kube/handover.py): the port a waiting Pod listens on, the variables that
# tell its runner (task.py wait_for_handover), and the second policy that opens that port.
HANDOVER_PORT = 7433
HANDOVER_PORT_ENV = "ROLLOUT_HANDOVER_PORT"
HANDOVER_TOKEN_ENV = "ROLLOUT_HANDOVER_TOKEN"
HANDOVER_POLICY_NAME = "warm-handover"


def pool_handover_policy(key: str, cidr: str) -> dict[str, Any]:
    """One ingress rule: TCP to the hand-over port from the workers' CIDR. A policy of its own
    beside deny-all (policies add up): a pool namespace made by an attach-only worker gets it
    from the first direct-mode fill. The runner closes the port before its episode runs."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": HANDOVER_POLICY_NAME,
            "namespace": pool_namespace(key),
            "labels": pool_labels(key),
        },
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"ipBlock": {"cidr": cidr}}],
                    "ports": [{"protocol": "TCP", "port": HANDOVER_PORT}],
                }
            ],
        },
    }


def pool_lifetime_seconds(spec: BatchSpec, idle_seconds: float) -> int:
    return math.ceil(idle_seconds) + LIFETIME_EXTRA_SECONDS + spec.episode_timeout_seconds


def pool_pod_manifest(
    spec: BatchSpec, key: str, idle_seconds: float, *, handover_token: str | None = None
) -> dict[str, Any]:
    """A pool Pod: a cold sandbox's spec (same isolation), waiting on stdin for its episode
    and, given a `handover_token` (one per Pod), on HANDOVER_PORT too (direct hand-over).
    No startup probe: a probe execs into every waiting Pod each second."""
    image = pool_image(spec)
    if image is None:
        raise ValueError("a pool serves batches of one image")
    env = [{"name": "ROLLOUT_HANDOVER", "value": "stdin"}]
    if handover_token is not None:
        env += [
            {"name": HANDOVER_PORT_ENV, "value": str(HANDOVER_PORT)},
            {"name": HANDOVER_TOKEN_ENV, "value": handover_token},
        ]
    lifetime = pool_lifetime_seconds(spec, idle_seconds)
    pod_spec = sandbox_pod_spec(spec, image, env, lifetime, warm=True)
    pod_spec["containers"][0] |= {"stdin": True, "stdinOnce": True}
    if handover_token is not None:
        pod_spec["containers"][0]["ports"] = [
            {"name": "handover", "containerPort": HANDOVER_PORT, "protocol": "TCP"}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": POOL_POD_PREFIX,
            "namespace": pool_namespace(key),
            "labels": pool_labels(key) | {k.LABEL_POOL_STATE: POOL_STATE_IDLE},
        },
        "spec": pod_spec,
    }


def claim_patch(
    pod: dict[str, Any],
    started: float | None,
    batch_id: str,
    index: int,
    episode_timeout: int,
    now: float,
) -> dict[str, Any] | None:
    """The merge patch that makes a waiting Pod episode `index` of a batch, or None when the
    Pod has too little lifetime left. `resourceVersion` makes the server refuse it (409) if the
    Pod changed since it was read: another batch claimed it first.

    activeDeadlineSeconds counts from the Pod's start (`started`) and may only go down: the
    episode gets its own timeout from now."""
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
                k.LABEL_POOL_STATE: POOL_STATE_CLAIMED,
                k.LABEL_EPISODE_INDEX: str(index),
            },
            "annotations": {k.ANNOTATION_CLAIMED_AT: f"{now:.6f}"},
        },
        "spec": {"activeDeadlineSeconds": deadline},
    }

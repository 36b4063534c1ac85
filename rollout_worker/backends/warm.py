"""Warm pools, backend-neutral: which batches can share a pool (the shape key) and the line that
makes a waiting sandbox an episode. Imports `rollout_wire` only; each backend keeps its pool's
objects and I/O (`kube/objects.py` + `kube/pools.py`, `local/pool.py`).

A pool serves one sandbox shape (image, RuntimeClass, resources, placement, policy endpoint and
episode program). Its sandboxes run the episode program up to the point where it needs its
episode (interpreter started, imports done) and wait on stdin; a claimed sandbox reads one line
(`handover_line`), runs one episode and is never reused.

Why per policy endpoint: a NetworkPolicy is applied when a Pod starts on some CNIs (this
project's local node among them), so a Pod's egress must be right before it waits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import orjson

from rollout_wire.request import BatchSpec
from rollout_wire.tasksets import agent_view, demo_task

# Where the hand-over writes a real rollout's task (the sandbox's own /tmp, memory-backed).
TASKS_FILE = "/tmp/rollout-tasks.json"


def task_image(spec: BatchSpec, task: Mapping[str, Any]) -> str:
    """The image a task's episodes run: its own (a Harbor task's environment), else the
    batch's. Every backend and pool decides by this one rule."""
    image: str = task.get("image") or spec.image
    return image


def pool_image(spec: BatchSpec) -> str | None:
    """The one image of a batch's episodes, or None when they use several."""
    images = {task_image(spec, task) for task in spec.tasks} or {spec.image}
    return images.pop() if len(images) == 1 else None


def pool_key(spec: BatchSpec, program: str, *, grades_within: bool = False) -> str | None:
    """Which pool a batch takes from, or None when it can take none: its episodes use several
    images, it has a retry budget (a warm episode has no Job to run it again), or hidden tests
    unless the backend's sandbox grades within itself (`grades_within`: the tests travel in
    the hand-over apart from the task, and its runner keeps them in memory; otherwise the
    grader is a second sandbox that a warm one does not have)."""
    image = pool_image(spec)
    hidden = any(t.get("tests") for t in spec.tasks)
    if image is None or spec.infra_retries or (hidden and not grades_within):
        return None
    shape: dict[str, Any] = {
        "image": image,
        "runtime": spec.runtime,
        "image_pull_policy": spec.image_pull_policy,
        "resources": asdict(spec.resources),
        "node_selector": spec.node_selector,
        "tolerations": spec.tolerations,
        "policy": spec.policy.endpoint if spec.policy is not None else None,
        "program": hashlib.sha256(program.encode()).hexdigest(),
    }
    # What a sandbox's folders depend on (kube pod_spec.sandbox_pod_spec): a writable root for
    # tasks whose tests come after the agent, the agent's own folders for agent commands.
    # Only named when present, so the other shapes keep their keys.
    if hidden:
        shape["writable_root"] = True
    if any("agent" in t for t in spec.tasks):
        shape["agent_dirs"] = True
    return hashlib.sha256(orjson.dumps(shape, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


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
        values |= dict(policy_access or {"ROLLOUT_POLICY_URL": spec.policy.url})
        values |= {
            "ROLLOUT_POLICY": spec.policy.runner_json(),
            "ROLLOUT_TASKS_FILE": TASKS_FILE,
            "ROLLOUT_TASK_ID": episode.task_id,
            "ROLLOUT_SAMPLE": str(episode.sample),
            "ROLLOUT_GROUP_ID": episode.group_id,
            "ROLLOUT_ATTEMPT": "0",
        }
        # What the agent may see (agent_view: no tests, no solution but the oracle's); the
        # tests apart, for the runner's memory alone (its take_handover).
        line["tasks"] = [agent_view(task)]
        if task.get("tests"):
            line["hidden_tests"] = {task["id"]: task["tests"]}
    return orjson.dumps(line) + b"\n"

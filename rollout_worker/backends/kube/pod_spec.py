"""The Pod spec of one sandbox, cold (a Job's template) or warm (a pool Pod), built as plain
dicts. Pure: same spec in, same dicts out. The container, its volumes and its security
context each have their builder; a batch whose tests the agent must not see adds an agent's
init container (grades_apart), with a seed of its workspace when its task is its own image
(seeds_workspace), or a stash of its tests (stashes_tests).
"""

from __future__ import annotations

import copy
from typing import Any

from rollout_wire.request import BatchSpec, Task
from rollout_wire.resources import DEFAULT_STORAGE_LIMIT
from rollout_worker.backends.kube import task_env
from rollout_worker.backends.kube.pod_steps import chain_steps, step_count
from rollout_worker.backends.warm import task_image
from rollout_worker.observation import EXIT_INFRASTRUCTURE

CONFIGMAP_NAME = "episode"
CONTAINER_NAME = "episode"
# A batch whose tests the agent must not see runs its agent in an init container of this
# name; the Pod's one container (CONTAINER_NAME) then only grades (grades_apart).
AGENT_CONTAINER = "agent"
AGENT_TASKS_KEY = "tasks-agent.json"
# A batch whose tests must reach a runner in its agent's own container (stashes_tests): the
# init container that copies them to STASH_DIR, a memory folder only that container mounts.
STASH_CONTAINER = "stash"
STASH_DIR = "/rollout-stash"
# argv: source, destination, the exit code of a failed copy (infrastructure: retried).
_STASH_COPY = """import shutil, sys
try:
    shutil.copyfile(sys.argv[1], sys.argv[2])
except OSError as exc:
    print(exc, file=sys.stderr)
    sys.exit(int(sys.argv[3]))
"""
# A `fresh` grader of a task in its own image (seeds_workspace): the first init container, of
# that image, copies its workdir into the workspace volume, mounted there at SEED_DIR.
SEED_CONTAINER = "seed"
SEED_DIR = "/rollout-seed"
# Where the agent's runner leaves its baseline counts for the grader (written after every
# process of the agent's is gone; validation checks the grader used what the log says).
HANDOFF_DIR = "/handoff"
PROGRAM_DIR = "/demo"
# The runner's `ready` marker, on the Pod's own /tmp (see ready_probe).
READY_FILE = "/tmp/rollout-ready"
PROGRAM_KEY = "episode.py"
TASKS_KEY = "tasks.json"
SANDBOX_UID = 1000
# An episode's share of its node's disk (its workspace and other folders, a writable root,
# its logs) is the batch's `resources.storage_limit` (this by default): past it the kubelet
# evicts the Pod instead of the node filling up (the episode's own failure: read.py). Each
# folder on disk has it as its sizeLimit too. Requested at 0: a request would keep Pods off
# nodes that report no ephemeral-storage (KWOK's), and it is the limit that protects the node.
EPISODE_STORAGE_LIMIT = DEFAULT_STORAGE_LIMIT
EPISODE_STORAGE_REQUEST = "0"
# The writable folders an agent's episode has besides its workspace and /tmp.
AGENT_DIRS = {"agent-logs": "/logs", "agent-tests": "/tests", "agent-solution": "/solution"}


def tasks_of(spec: BatchSpec, image: str | None) -> list[Task]:
    """The tasks whose episodes run `image` (every task when None): one Job's, decided alike."""
    if image is None:
        return list(spec.tasks)
    return [t for t in spec.tasks if task_image(spec, t) == image]


def seeds_workspace(spec: BatchSpec, image: str | None = None) -> bool:
    """Whether `image`'s episodes (the whole batch's when None) include a task in its own image
    graded `fresh` (parse_spec then grades every task of that image so, at its workdir). Its
    workspace is a volume that a first init container of the image fills with the image's
    workdir; the agent's init container and then the grader, each a fresh container of the
    image, mount it at the workdir, and share nothing else (SEED_CONTAINER)."""
    return any(t.get("image") and t.get("grade") == "fresh" for t in tasks_of(spec, image))


def grades_apart(spec: BatchSpec, image: str | None = None) -> bool:
    """Whether the agents and graders of `image`'s episodes (of the whole batch when None)
    run in separate containers: tasks with hidden tests (`tests`), steps or `grade: fresh`, none of
    which runs in its own image (whose folders, where such an agent works, a second container
    would not share), or a task in its own image graded `fresh` (seeds_workspace). The agent
    then runs in an init container that is given each task without its tests, and the Pod's
    container grades after it, over the same workspace, /tmp and /logs (`same`) or over the
    workspace alone, the rest emptied first or never shared (`fresh`)."""
    tasks = tasks_of(spec, image)
    apart = any(t.get("tests") or t.get("steps") or t.get("grade") == "fresh" for t in tasks)
    own = any(t.get("image") for t in tasks)
    return (apart and not own) or seeds_workspace(spec, image)


def stashes_tests(spec: BatchSpec, image: str | None = None) -> bool:
    """Whether the batch's hidden tests reach a runner that grades in its agent's container (a
    task in its own image, whose folders a second container would not share): an init
    container copies the tasks with their tests to a memory folder of the Pod, the container
    mounts the tasks without them, and its runner reads that copy and removes it before any
    agent process exists (HIDDEN_TASKS_ENV in the episode program)."""
    tasks = tasks_of(spec, image)
    return not grades_apart(spec, image) and any(t.get("tests") for t in tasks)


def ready_probe(spec: BatchSpec) -> dict[str, Any]:
    """The startup probe that turns the runner's `ready` event into Pod status: the runner
    creates READY_FILE when it emits the event, and the container counts as started once the
    kubelet sees the file. Collectors learn of it from the Pod watch they already hold, so
    progress costs no log read. The probe runs about once a second only until it passes, and
    its failure threshold outlasts the episode's own deadline, so it never stops an episode."""
    return {
        "exec": {"command": ["python", "-S", "-c", f"import os; os.stat({READY_FILE!r})"]},
        "periodSeconds": 1,
        "timeoutSeconds": 1,
        "failureThreshold": spec.episode_timeout_seconds + 10,
    }


def runs_own_image(spec: BatchSpec, image: str) -> bool:
    """Whether the tasks of `image` run in their own image (whose files at their workdir are
    the workspace: no volume hides them)."""
    return any(t.get("image") == image for t in spec.tasks)


def sandbox_pod_spec(
    spec: BatchSpec,
    image: str,
    env: list[dict[str, Any]],
    active_deadline: int,
    *,
    warm: bool = False,
    workdir: str | None = None,
) -> dict[str, Any]:
    """The Pod spec of one sandbox, cold (a Job's template) or warm (a pool Pod): the same
    isolation either way (non-root, no capabilities, no token, read-only root). A warm one
    gets its task, and any hidden tests, through its hand-over, never from a stash. `workdir`:
    where its episodes work (their tasks' Harbor [environment] workdir), else /workspace."""
    workspace = workdir or "/workspace"
    pod_spec: dict[str, Any] = {
        "runtimeClassName": spec.runtime,
        "restartPolicy": "Never",
        # Nothing in a sandbox needs a graceful stop: a deadline or a deletion ends it at once
        # instead of 30 s later (Python as PID 1 ignores SIGTERM).
        "terminationGracePeriodSeconds": 1,
        "activeDeadlineSeconds": active_deadline,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [sandbox_container(spec, image, env, workspace)],
        "volumes": sandbox_volumes(spec),
    }
    if any("agent" in task or task.get("steps") for task in spec.tasks):
        _add_agent_dirs(pod_spec, spec.resources.storage_limit)
    if seeds_workspace(spec, image):
        _grade_apart(pod_spec, seeded=workspace)
    elif grades_apart(spec, image):
        _grade_apart(pod_spec)
        if count := step_count(tasks_of(spec, image)):
            chain_steps(pod_spec, count)  # agent, tests, agent, ... (pod_steps.py)
    elif stashes_tests(spec, image) and not warm:
        _stash_tests(pod_spec)
    elif task_env.has_env(tasks_of(spec, image)):
        _agent_tasks_only(pod_spec)
    if not warm:  # a warm Pod's task comes later; such batches never take one (pool_key)
        task_env.add_task_env(pod_spec, tasks_of(spec, image))
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    return pod_spec


def pod_security_context() -> dict[str, Any]:
    """Every process of the Pod runs as the sandbox's user, never root."""
    return {
        "runAsUser": SANDBOX_UID,
        "runAsGroup": SANDBOX_UID,
        "fsGroup": SANDBOX_UID,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(spec: BatchSpec) -> dict[str, Any]:
    """No escalation, no capabilities; a read-only root unless a task's tests need it."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        # Harbor-style tasks (tests placed at /tests) act on their image's own
        # folders (its WORKDIR, say /app): their root stays writable, to the
        # sandbox's user only (non-root, no capabilities).
        "readOnlyRootFilesystem": not any("tests" in t for t in spec.tasks),
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_resources(spec: BatchSpec) -> dict[str, Any]:
    """The batch's CPU and memory, and the episode's share of its node's disk."""
    res = spec.resources
    return {
        "requests": {
            "cpu": res.cpu_request,
            "memory": res.memory_request,
            "ephemeral-storage": EPISODE_STORAGE_REQUEST,
        },
        "limits": {
            "cpu": res.cpu_limit,
            "memory": res.memory_limit,
            "ephemeral-storage": res.storage_limit,
        },
    }


def sandbox_container(
    spec: BatchSpec, image: str, env: list[dict[str, Any]], workspace: str
) -> dict[str, Any]:
    """The Pod's one container: the episode program over `workspace`. A task in its own image
    keeps its files at its workdir (no volume hides them): the volume stays at /workspace."""
    own_image = runs_own_image(spec, image)
    return {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python", "-B", f"{PROGRAM_DIR}/{PROGRAM_KEY}"],
        "workingDir": workspace,
        "env": [
            {
                "name": "EPISODE_ID",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
            },
            {"name": "ROLLOUT_WORKSPACE", "value": workspace},
            {"name": "ROLLOUT_READY_FILE", "value": READY_FILE},
            # The container's own cgroup holds every process of the sandbox: the
            # runner's cost ledger reads it (the local sandbox sums its /proc).
            {"name": "ROLLOUT_COST_SOURCE", "value": "cgroup"},
            *env,
        ],
        "securityContext": container_security_context(spec),
        "resources": container_resources(spec),
        "terminationMessagePolicy": "File",
        "volumeMounts": [
            {"name": "program", "mountPath": PROGRAM_DIR, "readOnly": True},
            {"name": "workspace", "mountPath": "/workspace" if own_image else workspace},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def sandbox_volumes(spec: BatchSpec) -> list[dict[str, Any]]:
    """The program (the ConfigMap), the workspace (the episode's disk limit) and a memory
    /tmp, each bounded."""
    return [
        {"name": "program", "configMap": {"name": CONFIGMAP_NAME}},
        {"name": "workspace", "emptyDir": {"sizeLimit": spec.resources.storage_limit}},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
    ]


def _add_agent_dirs(pod_spec: dict[str, Any], storage_limit: str) -> None:
    """An agent's episode writes outside its workspace: Harbor's /logs/verifier, the tests
    placed at /tests after the agent, the oracle's /solution (the root stays read-only)."""
    container = pod_spec["containers"][0]
    for name, path in AGENT_DIRS.items():
        container["volumeMounts"].append({"name": name, "mountPath": path})
        pod_spec["volumes"].append({"name": name, "emptyDir": {"sizeLimit": storage_limit}})


def _agent_program_volume() -> dict[str, Any]:
    """The program folder an agent's container mounts: the program and the tasks without
    their tests (as TASKS_KEY)."""
    items = [
        {"key": PROGRAM_KEY, "path": PROGRAM_KEY},
        {"key": AGENT_TASKS_KEY, "path": TASKS_KEY},
    ]
    return {"name": "agent-program", "configMap": {"name": CONFIGMAP_NAME, "items": items}}


def _agent_tasks_only(pod_spec: dict[str, Any]) -> None:
    """The one container of tasks with env tables, that acts and grades: it mounts the tasks as
    its agent may read them (AGENT_TASKS_KEY: the env tables its runner hands on and no
    other's text), as a local sandbox does. Its runner needs nothing else: no hidden tests."""
    container = pod_spec["containers"][0]
    container["volumeMounts"] = [
        {"name": "agent-program", "mountPath": PROGRAM_DIR, "readOnly": True}
        if m["name"] == "program"
        else m
        for m in container["volumeMounts"]
    ]
    pod_spec["volumes"].append(_agent_program_volume())


def _stash_tests(pod_spec: dict[str, Any]) -> None:
    """See stashes_tests: the container mounts the tasks without their tests, and an init
    container (the same image, user and limits) leaves the full tasks file in a memory
    folder only the container mounts, for its runner to take and remove."""
    container = pod_spec["containers"][0]
    stash = copy.deepcopy(container)
    stash["name"] = STASH_CONTAINER
    stash["command"] = [
        "python", "-B", "-I", "-c", _STASH_COPY,
        f"{PROGRAM_DIR}/{TASKS_KEY}", f"{STASH_DIR}/{TASKS_KEY}", str(EXIT_INFRASTRUCTURE),
    ]  # fmt: skip
    stash["env"] = []
    stash["volumeMounts"] = [
        {"name": "program", "mountPath": PROGRAM_DIR, "readOnly": True},
        {"name": "stash", "mountPath": STASH_DIR},
    ]
    stash.pop("terminationMessagePolicy", None)
    container["volumeMounts"] = [
        {"name": "agent-program", "mountPath": PROGRAM_DIR, "readOnly": True}
        if m["name"] == "program"
        else m
        for m in container["volumeMounts"]
    ] + [{"name": "stash", "mountPath": STASH_DIR}]
    container["env"] = [
        *container["env"],
        {"name": "ROLLOUT_HIDDEN_TASKS_FILE", "value": f"{STASH_DIR}/{TASKS_KEY}"},
    ]
    pod_spec["volumes"] += [
        _agent_program_volume(),
        {"name": "stash", "emptyDir": {"medium": "Memory", "sizeLimit": "2Mi"}},
    ]
    pod_spec["initContainers"] = [stash]


def _grade_apart(pod_spec: dict[str, Any], seeded: str | None = None) -> None:
    """The agent as an init container that never sees the tests: its program folder holds
    the tasks without them and it mounts no /tests; its runner ends with grade_pending. The
    kubelet starts the Pod's container only after it exited 0 (every process of the agent
    gone with it), and that container grades over the same workspace, /tmp and /logs (a
    `fresh` grader empties all but the workspace first: ROLLOUT_SHARED_DIRS). `seeded`: the
    workdir of a task in its own image graded `fresh` (_seed_workspace): the workspace volume
    is mounted there, and the agent's other folders are its own."""
    grader = pod_spec["containers"][0]
    if seeded is not None:
        for mount in grader["volumeMounts"]:
            if mount["name"] == "workspace":
                mount["mountPath"] = seeded
    agent = copy.deepcopy(grader)
    agent["name"] = AGENT_CONTAINER
    handoff = {"name": "handoff", "mountPath": HANDOFF_DIR}
    agent["volumeMounts"] = [
        {"name": "agent-program", "mountPath": PROGRAM_DIR, "readOnly": True},
        *(m for m in grader["volumeMounts"] if m["name"] not in ("program", "agent-tests")),
        handoff,
    ]
    if seeded is not None:
        _agent_folders_apart(pod_spec, agent)
    agent["env"] = [
        *agent["env"],
        {"name": "ROLLOUT_GRADER", "value": "sandbox"},
        {"name": "ROLLOUT_HANDOFF_DIR", "value": HANDOFF_DIR},
    ]
    # What the grader shares with the agent's container besides the workspace: a `fresh`
    # grader empties them before anything else (the Pod's /dev/shm is shared too).
    both = {m["name"] for m in agent["volumeMounts"]} - {"workspace", "handoff"}
    shared = [m["mountPath"] for m in grader["volumeMounts"] if m["name"] in both]
    grader["env"] = [
        *grader["env"],
        {"name": "ROLLOUT_PHASE", "value": "grade"},
        {"name": "ROLLOUT_HANDOFF_DIR", "value": HANDOFF_DIR},
        {"name": "ROLLOUT_SHARED_DIRS", "value": ":".join([*shared, "/dev/shm"])},
    ]
    grader["volumeMounts"] = [*grader["volumeMounts"], handoff | {"readOnly": True}]
    pod_spec["volumes"] += [
        _agent_program_volume(),
        {"name": "handoff", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
    ]
    pod_spec["initContainers"] = [agent]
    if seeded is not None:
        _seed_workspace(pod_spec, seeded)


def _agent_folders_apart(pod_spec: dict[str, Any], agent: dict[str, Any]) -> None:
    """The agent's /tmp, /logs and /solution as volumes of its own (same kind and size): a
    fresh grader shares only the workspace with it (and the Pod's /dev/shm, emptied)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = []
    for mount in agent["volumeMounts"]:  # the grader's own mounts, shared: never changed
        if mount["name"] not in ("workspace", "handoff", "agent-program"):
            own = f"{mount['name']}-of-agent"
            pod_spec["volumes"].append(copy.deepcopy(volumes[mount["name"]]) | {"name": own})
            mount = mount | {"name": own}
        mounts.append(mount)
    agent["volumeMounts"] = mounts


def _seed_workspace(pod_spec: dict[str, Any], workdir: str) -> None:
    """The first init container: the task's image again (same user, limits and isolation),
    its runner in the seed phase copies the image's `workdir` into the workspace volume
    (runner/seed.py), which the agent's container and the grader mount at that workdir. It
    mounts the tasks without their tests. Its working folder is / (a missing workdir is the
    task's error, never an empty folder the runtime made)."""
    seed = copy.deepcopy(pod_spec["initContainers"][0])
    seed["name"] = SEED_CONTAINER
    seed["workingDir"] = "/"
    seed["env"] = [
        {"name": "EPISODE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ROLLOUT_PHASE", "value": "seed"},
        {"name": "ROLLOUT_SEED_FROM", "value": workdir},
        {"name": "ROLLOUT_SEED_TO", "value": SEED_DIR},
    ]
    seed["volumeMounts"] = [
        {"name": "agent-program", "mountPath": PROGRAM_DIR, "readOnly": True},
        {"name": "workspace", "mountPath": SEED_DIR},
    ]
    pod_spec["initContainers"].insert(0, seed)

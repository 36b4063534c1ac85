"""The batch request: what a trainer asks for, parsed and validated once at each edge.

`parse_spec` reports every problem at once, before any side effect, so bad input never creates
anything. After it, only the typed, frozen `BatchSpec` travels; `BatchSpec.from_dict` only
decodes a spec that was validated before (a stored receipt), it re-applies no policy.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeGuard

import orjson

from rollout_wire.errors import InvalidSpec
from rollout_wire.policy import PolicyEndpoint, parse_policy
from rollout_wire.states import GroupFilter

BACKENDS = ("local", "kubernetes")
# The episode's action: `fix` is the guide's deterministic stand-in for an agent; `none`
# leaves the bug in place (reward 0, the episode fails); `hang` never finishes (exercises
# deadlines).
ACTIONS = ("fix", "none", "hang")

DEFAULT_IMAGE = "python:3.12-alpine"
DEFAULT_RUNTIME = "cube"
DEFAULT_DEADLINE_SECONDS = 240
DEFAULT_EPISODE_TIMEOUT_SECONDS = 120
# Enough that a few unlucky sandboxes never halt a batch, few enough that a dead policy
# endpoint costs a handful of sandboxes per slot instead of the whole batch.
DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES = 20
MAX_EPISODES_EVER = 1_000_000
MAX_DEADLINE_SECONDS = 7 * 24 * 3600

_BATCH_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A container image reference: [registry[:port]/]path[:tag][@digest], lower-case path parts.
_IMAGE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def new_batch_id() -> str:
    return uuid.uuid4().hex[:16]


def is_batch_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(_BATCH_ID.match(value))


@dataclass(frozen=True)
class Resources:
    """Per-sandbox requests and limits, in Kubernetes quantity syntax."""

    cpu_request: str = "100m"
    memory_request: str = "64Mi"
    cpu_limit: str = "500m"
    memory_limit: str = "128Mi"


@dataclass(frozen=True)
class BatchSpec:
    """One sampling round's request: `count` episodes, at most `parallelism` at a time."""

    batch_id: str
    count: int
    parallelism: int
    backend: str = "local"
    image: str = DEFAULT_IMAGE
    runtime: str = DEFAULT_RUNTIME
    deadline_seconds: int = DEFAULT_DEADLINE_SECONDS
    episode_timeout_seconds: int = DEFAULT_EPISODE_TIMEOUT_SECONDS
    resources: Resources = field(default_factory=Resources)
    action: str = "fix"
    submitted_at: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    # Kubernetes placement and policy (ignored by the local backend).
    image_pull_policy: str = "IfNotPresent"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    capacity_check: str = "error"  # error | warn | off
    # Keep the run (namespace, local directory) after the report, for `rollout cleanup`.
    keep_run: bool = False
    # Real rollouts: the tasks (resolved to data at the client's edge), samples per task
    # (group size) and the policy the agent runner asks for actions. No tasks: the guide's
    # demo task, `count` samples of it (one group); no policy: the demo's fixed `action`.
    tasks: list[dict[str, Any]] = field(default_factory=list)
    samples_per_task: int = 1
    policy: PolicyEndpoint | None = None
    # Retry budget: how many times an episode that failed for infrastructure reasons (the
    # runner's exit code 4: policy endpoint unreachable, no task; or its sandbox disrupted) is
    # run again, each time in a fresh sandbox. Episode failures and deadlines are never retried.
    infra_retries: int = 0
    # After this batch has taken what it can from the warm pool of its shape,
    # refill that pool to this many waiting sandboxes for the next batch (0: no refill). Every
    # batch takes from an existing pool of its shape, whether or not it asks for a refill.
    warm_pool: int = 0
    # The circuit breaker: after this many infrastructure failures in a row (the policy
    # endpoint down, sandboxes that never get ready), the batch halts: the rest is aborted and
    # the report says `halted` with the failures that tripped it (0: never halt).
    max_consecutive_infra_failures: int = DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES
    # The quota: once this many groups passing `group_filter` are complete, the batch is over
    # and every episode not yet ended is aborted (0: no quota, every episode runs).
    groups_wanted: int = 0
    group_filter: str = GroupFilter.ANY
    # The trainer's policy version when the batch was submitted (the client fills it in from
    # the version the trainer published, if any).
    policy_version: str | None = None
    # The agent every task without its own runs (`TASK_FIELDS["agent"]`): a command, or
    # "oracle"; None: the built-in runner loop. Resolved into the tasks by `parse_spec`.
    agent: Any = None
    # Local backend: a directory of the worker's machine (a virtual environment holding the
    # agent) shown read-only to every sandbox at the same path; the worker allows only the
    # roots it is configured with (ROLLOUT_AGENT_ENV_ROOTS).
    agent_env: str | None = None

    def group_of(self, index: int) -> range:
        """The indexes of the group episode `index` belongs to (a task's samples)."""
        if not self.tasks:
            return range(self.count)
        start = index - index % self.samples_per_task
        return range(start, start + self.samples_per_task)

    def episode(self, index: int) -> EpisodeTask:
        """Which task and sample episode `index` runs, and its group."""
        if not self.tasks:
            task_id, task_index, sample = DEMO_TASK_ID, None, index
        else:
            position, sample = divmod(index, self.samples_per_task)
            task_id, task_index = str(self.tasks[position]["id"]), position
        return EpisodeTask(index, task_index, task_id, sample, group_id(self.batch_id, task_id))

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON types only; the policy as its request object)."""
        values = asdict(self)
        values["policy"] = self.policy.to_dict() if self.policy is not None else None
        return values

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchSpec:
        """Decode a spec validated before (a stored receipt); no limits are re-applied."""
        values = dict(data)
        values["resources"] = Resources(**values.get("resources", {}))
        policy = values.get("policy")
        values["policy"] = PolicyEndpoint.from_dict(policy) if policy is not None else None
        return cls(**values)


@dataclass(frozen=True)
class EpisodeTask:
    """One episode's place in its batch: the task it runs (`task_index` None for the built-in
    demo), its sample number within the task's group, and the group id trainers join on."""

    index: int
    task_index: int | None
    task_id: str
    sample: int
    group_id: str


def group_id(batch_id: str, task_id: str) -> str:
    """The samples of one task in one batch share this id (trainers join on it)."""
    return f"{batch_id}:{task_id}"


def _int_field(data: Mapping[str, Any], name: str, default: int, problems: list[str]) -> int:
    """The integer at `name`; a non-integer is reported and replaced by `default`."""
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{name} must be an integer, got {value!r}")
        return default
    return value


def parse_spec(data: Mapping[str, Any], *, max_episodes: int | None) -> BatchSpec:
    """Validate a batch request (a JSON object) and return it as a BatchSpec.

    `max_episodes` is the deployment's limit (ROLLOUT_MAX_BATCH_EPISODES); None where it is
    not known (a trainer's process), the workers then enforce it.
    Raises InvalidSpec listing every problem, each saying what was wrong and what is allowed.
    """
    if not isinstance(data, Mapping):
        raise InvalidSpec([f"a batch request must be a JSON object, got {type(data).__name__}"])
    problems: list[str] = []
    known = {f.name for f in fields(BatchSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        problems.append(f"unknown fields {unknown}; allowed: {sorted(known)}")

    batch_id = data.get("batch_id") or new_batch_id()
    if not is_batch_id(batch_id):
        problems.append(
            f"batch_id {batch_id!r} must be 1-40 lower-case letters, digits or '-', "
            "starting and ending with a letter or digit"
        )

    tasks = _parse_tasks(data.get("tasks"), problems)
    samples = _int_field(data, "samples_per_task", 1, problems)
    if not 1 <= samples <= MAX_SAMPLES_PER_TASK:
        problems.append(f"samples_per_task must be within 1..{MAX_SAMPLES_PER_TASK}, got {samples}")
        samples = 1
    if tasks:
        # A batch is the task set times samples_per_task; `count` may only repeat that.
        count = len(tasks) * samples
        if data.get("count") is not None and data.get("count") != count:
            problems.append(
                f"count {data.get('count')!r} disagrees with {len(tasks)} task(s) x "
                f"samples_per_task {samples} = {count}; leave count out with tasks"
            )
    else:
        if data.get("samples_per_task") not in (None, 1):
            problems.append(
                "samples_per_task needs tasks; the built-in demo runs `count` samples of its "
                "one task"
            )
        samples = 1
        count = _int_field(data, "count", 10, problems)
    parallelism = (
        count
        if data.get("parallelism") is None
        else _int_field(data, "parallelism", count, problems)
    )
    if count < 1:
        problems.append(f"count must be at least 1, got {count}")
    elif max_episodes is not None and count > max_episodes:
        problems.append(
            f"count {count} exceeds the configured maximum of {max_episodes} episodes per "
            "batch (ROLLOUT_MAX_BATCH_EPISODES); split it into several batches"
        )
    elif not 1 <= parallelism <= count:
        problems.append(
            f"parallelism must satisfy 1 <= parallelism <= count ({count}), got {parallelism}"
        )

    backend = data.get("backend", "local")
    if backend not in BACKENDS:
        problems.append(f"backend {backend!r} is not one of {list(BACKENDS)}")

    image = data.get("image", DEFAULT_IMAGE)
    if not isinstance(image, str) or len(image) > 255 or not _IMAGE.match(image):
        problems.append(
            f"image {image!r} is not a valid image reference like 'python:3.12-alpine' or "
            "'registry.example.com/team/python:3.12@sha256:<64 hex>'"
        )
    runtime = data.get("runtime", DEFAULT_RUNTIME)
    if not isinstance(runtime, str) or len(runtime) > 253 or not _DNS_SUBDOMAIN.match(runtime):
        problems.append(
            f"runtime {runtime!r} is not a valid RuntimeClass name (lower-case DNS subdomain, "
            "e.g. 'cube' or 'runc')"
        )

    deadline = _int_field(data, "deadline_seconds", DEFAULT_DEADLINE_SECONDS, problems)
    if not 1 <= deadline <= MAX_DEADLINE_SECONDS:
        problems.append(
            f"deadline_seconds must be within 1..{MAX_DEADLINE_SECONDS}, got {deadline}"
        )
    episode_timeout = _int_field(
        data, "episode_timeout_seconds", min(DEFAULT_EPISODE_TIMEOUT_SECONDS, deadline), problems
    )
    if not 1 <= episode_timeout <= max(deadline, 1):
        problems.append(
            f"episode_timeout_seconds must be within 1..deadline_seconds ({deadline}), "
            f"got {episode_timeout} (rollout run: raise --deadline or lower --episode-timeout)"
        )

    resources = _parse_resources(data.get("resources", {}), problems)

    action = data.get("action", "fix")
    if action not in ACTIONS:
        problems.append(f"action {action!r} is not one of {list(ACTIONS)}")

    submitted_at = data.get("submitted_at") or time.time()
    if isinstance(submitted_at, bool) or not isinstance(submitted_at, (int, float)):
        problems.append(f"submitted_at must be a unix time in seconds, got {submitted_at!r}")
        submitted_at = 0.0

    labels = data.get("labels", {}) or {}
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and _LABEL_KEY.match(k) and isinstance(v, str) and len(v) <= 256
        for k, v in labels.items()
    ):
        problems.append("labels must map short names ([A-Za-z0-9_.-]) to strings (<= 256 chars)")
        labels = {}

    retries = _int_field(data, "infra_retries", 0, problems)
    if not 0 <= retries <= MAX_INFRA_RETRIES:
        problems.append(f"infra_retries must be within 0..{MAX_INFRA_RETRIES}, got {retries}")
        retries = 0

    warm = _int_field(data, "warm_pool", 0, problems)
    if not 0 <= warm <= MAX_WARM_POOL:
        problems.append(f"warm_pool must be within 0..{MAX_WARM_POOL}, got {warm}")
        warm = 0

    breaker = _int_field(
        data, "max_consecutive_infra_failures", DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES, problems
    )
    if not 0 <= breaker <= MAX_EPISODES_EVER:
        problems.append(
            f"max_consecutive_infra_failures must be within 0..{MAX_EPISODES_EVER} "
            f"(0: never halt), got {breaker}"
        )
        breaker = DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES

    wanted = _int_field(data, "groups_wanted", 0, problems)
    groups = len(tasks) if tasks else 1
    if not 0 <= wanted <= groups:
        problems.append(
            f"groups_wanted must be within 0..{groups} (the batch's groups: one per task; "
            f"0: no quota), got {wanted}"
        )
        wanted = 0
    group_filter = data.get("group_filter", GroupFilter.ANY)
    if group_filter not in tuple(GroupFilter):
        problems.append(
            f"group_filter {group_filter!r} is not one of {[f.value for f in GroupFilter]}"
        )
        group_filter = GroupFilter.ANY
    version = data.get("policy_version")
    if version is not None and (not isinstance(version, str) or not 0 < len(version) <= 128):
        problems.append(f"policy_version must be text of 1..128 characters, got {version!r}")
        version = None

    agent = data.get("agent")
    if agent is not None:
        parse_agent(agent, "agent", problems)
        if not tasks:
            problems.append("agent needs tasks: the built-in demo has its fixed action")
    agent_env = data.get("agent_env")
    if agent_env is not None and (
        not isinstance(agent_env, str)
        or not agent_env.startswith("/")
        or ".." in agent_env.split("/")
        or len(agent_env) > 1024
    ):
        problems.append(f"agent_env must be an absolute directory path, got {agent_env!r}")
        agent_env = None
    own_fresh = [t.get("id") for t in tasks if t.get("image") and t.get("grade") == "fresh"]
    if backend == "kubernetes" and own_fresh:
        # A fresh grader is a second container of the Pod, which would not share the folders
        # of a task's own image where its agent worked.
        problems.append(
            "grade: fresh on Kubernetes needs a task in the batch's image: "
            f"{own_fresh[:3]} run in their own; grade those `same`"
        )
    if agent_env is not None and backend == "kubernetes":
        problems.append(
            "agent_env is for the local backend: on Kubernetes the image holds the agent"
        )
    if data.get("warm_pool") and any(isinstance(t.get("workdir"), str) for t in tasks):
        # A warm sandbox is started before its task is known: its workspace is /workspace.
        problems.append(
            "warm_pool cannot go with a task's workdir (a pool's sandboxes work in /workspace)"
        )

    placement = _parse_placement(data, problems)
    raw_policy = data.get("policy")
    if isinstance(raw_policy, PolicyEndpoint):
        raw_policy = raw_policy.to_dict()
    policy = parse_policy(raw_policy, problems)
    if backend == "kubernetes" and policy is not None and not policy.is_ip:
        problems.append(
            f"policy.url host {policy.host!r} must be an IP address on kubernetes: the batch's "
            "NetworkPolicy allows egress to that address only (it cannot match names)"
        )
    if tasks and not problems:
        # One Job per image on Kubernetes: the tasks of an image are grouped (in the order the
        # images first appear, the tasks' own order kept within each image), so each image's
        # episodes are one range of indexes.
        first_seen = {t.get("image") or image: None for t in tasks}
        order = {name: position for position, name in enumerate(first_seen)}
        tasks = sorted(tasks, key=lambda t: order[t.get("image") or image])
    if warm and retries:
        problems.append("warm_pool cannot go with infra_retries: a warm episode has no retry")
    if warm and len({t.get("image") or image for t in tasks}) > 1:
        problems.append("warm_pool needs one image for all tasks (a pool has one shape)")
    if agent is not None and not problems:
        tasks = [t if "agent" in t else t | {"agent": agent} for t in tasks]
        if agent == ORACLE:
            problems += _oracle_problems(tasks)
    oracle_only = bool(tasks) and all(t.get("agent") == ORACLE for t in tasks)
    if tasks and not isinstance(raw_policy, Mapping) and not oracle_only:
        problems.append("tasks need a policy to act (policy.url); only the demo has a fixed action")
    for task in tasks:
        limit = task.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS)
        if isinstance(limit, int) and limit >= episode_timeout:
            problems.append(
                f"task {task.get('id')!r}: time_limit_seconds {limit} must be below "
                f"episode_timeout_seconds ({episode_timeout}), which also covers setup and tests "
                "(rollout run: raise --episode-timeout, or lower the task's limit: Harbor's "
                "[agent] timeout_sec)"
            )

    if problems:
        raise InvalidSpec(problems)
    return BatchSpec(
        batch_id=str(batch_id),
        count=count,
        parallelism=parallelism,
        backend=str(backend),
        image=str(image),
        runtime=str(runtime),
        deadline_seconds=deadline,
        episode_timeout_seconds=episode_timeout,
        resources=resources,
        action=str(action),
        submitted_at=float(submitted_at),
        labels=dict(labels),
        tasks=tasks,
        samples_per_task=samples,
        policy=policy,
        infra_retries=retries,
        warm_pool=warm,
        max_consecutive_infra_failures=breaker,
        groups_wanted=wanted,
        group_filter=GroupFilter(group_filter),
        policy_version=version,
        agent=agent,
        agent_env=agent_env,
        **placement,
    )


PULL_POLICIES = ("IfNotPresent", "Never", "Always")
CAPACITY_CHECKS = ("error", "warn", "off")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def _parse_placement(data: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    pull = data.get("image_pull_policy", "IfNotPresent")
    if pull not in PULL_POLICIES:
        problems.append(f"image_pull_policy {pull!r} is not one of {list(PULL_POLICIES)}")
    check = data.get("capacity_check", "error")
    if check not in CAPACITY_CHECKS:
        problems.append(f"capacity_check {check!r} is not one of {list(CAPACITY_CHECKS)}")
    selector = data.get("node_selector") or {}
    if not isinstance(selector, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        problems.append("node_selector must map label names to string values")
        selector = {}
    tolerations = data.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(
        isinstance(t, Mapping) and set(t) <= _TOLERATION_KEYS for t in tolerations
    ):
        problems.append(
            f"tolerations must be a list of objects with keys from {sorted(_TOLERATION_KEYS)}"
        )
        tolerations = []
    keep = data.get("keep_run", False)
    if not isinstance(keep, bool):
        problems.append(f"keep_run must be true or false, got {keep!r}")
        keep = False
    return {
        "image_pull_policy": str(pull),
        "capacity_check": str(check),
        "node_selector": dict(selector),
        "tolerations": [dict(t) for t in tolerations],
        "keep_run": keep,
    }


# Which quantity forms a request may use (the policy); their values are compared by the workers
# with the Kubernetes client's own parser (`rollout_worker.quantities`).
_CPU_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_MEMORY_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def _parse_resources(data: Any, problems: list[str]) -> Resources:
    if isinstance(data, Resources):
        data = asdict(data)
    if not isinstance(data, Mapping):
        problems.append(f"resources must be an object, got {data!r}")
        return Resources()
    allowed = {f.name for f in fields(Resources)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        problems.append(f"unknown resources fields {unknown}; allowed: {sorted(allowed)}")
        return Resources()
    bad = False
    for name, value in data.items():
        pattern = _CPU_QUANTITY if name.startswith("cpu") else _MEMORY_QUANTITY
        if not isinstance(value, str) or not pattern.match(value):
            example = "'500m' or '1.5'" if name.startswith("cpu") else "'128Mi', '1Gi' or '500M'"
            problems.append(f"resources: {name} {value!r} is not a quantity like {example}")
            bad = True
    return Resources() if bad else Resources(**data)


# -- tasks (the policy: rollout_wire.policy) -----------------------------------------------------
DEMO_TASK_ID = "shipping-demo"
MAX_SAMPLES_PER_TASK = 256
MAX_INFRA_RETRIES = 3
MAX_WARM_POOL = 256
# A batch's tasks travel in the request, the receipt and (on Kubernetes) the batch's ConfigMap,
# whose whole object the API server caps at 1 MiB: the encoded tasks must stay below this.
MAX_TASKS_BYTES = 900 * 1024
MAX_TASKS = 1000
DEFAULT_TASK_TIME_LIMIT_SECONDS = 60
DEFAULT_MAX_STEPS = 10
MAX_STEPS = 200
REWARD_RULES = ("all", "fraction", "file")
# Where a `file` reward is read from, in this order (Harbor's verifier reads the JSON first):
# JSON with a numeric `reward` (its other numbers are kept as the row's details), or a number.
REWARD_FILES = ("/logs/verifier/reward.json", "/logs/verifier/reward.txt")
GRADES = ("same", "fresh")
ORACLE = "oracle"
# What the oracle agent runs, from the task's `solution` (Harbor's solution/solve.sh).
SOLVE_SCRIPT = "solve.sh"
# The agent's environment the runner sets itself (an agent's `env` may not override them).
AGENT_RESERVED_ENV = ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "OPENAI_MODEL")
MAX_AGENT_ARGS = 64
TASK_FIELDS = {
    "id": "lower-case name, unique in the batch",
    "statement": "the problem shown to the policy",
    "files": "path -> text: the repository the episode starts from",
    "test_files": "path -> text: written again just before the final tests (not editable)",
    "test_command": "argv list; 'python' means the sandbox's interpreter",
    "reward": "all (1 when every test passes, else 0) | fraction (passed / total) | file "
    "(what the tests wrote to /logs/verifier/reward.txt or reward.json)",
    "agent": "the agent to run instead of the built-in loop: {command: argv, env: {name: "
    "value}}, or 'oracle' (runs the task's solution/solve.sh)",
    "baseline": "true (default): the tests must fail before the agent acts; false: no check",
    "tests": "path -> text: placed at /tests only after the agent finished (it never sees them)",
    "solution": "path -> text: placed at /solution for the oracle agent only",
    "grade": "same (default): the tests run where the agent ran; fresh: in a new sandbox that "
    "receives only the workspace the agent left",
    "time_limit_seconds": "the agent loop's time limit",
    "test_timeout_seconds": "the test command's own time limit (default 60)",
    "workdir": "absolute path: where the agent and the tests run (default: the backend's "
    "workspace, /workspace or the image's WORKDIR)",
    "max_steps": "the agent loop's step limit",
    "image": "the image the task needs (kubernetes)",
    "description": "free text for people (not shown to the policy)",
}
# The runner's own test time limit (episode.py TESTS_TIMEOUT_SECONDS) when a task sets none.
DEFAULT_TEST_TIMEOUT_SECONDS = 60
_WORKDIR = re.compile(r"^/[A-Za-z0-9_.-]{1,100}(/[A-Za-z0-9_.-]{1,100}){0,15}$")
# Folders the sandbox itself mounts: a workspace there would hide or be hidden by them.
_RESERVED_DIRS = frozenset({"proc", "dev", "sys", "sandbox", "tmp", "logs", "tests", "solution"})
_TASK_ID = re.compile(r"^[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$")
_FILE_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")


def _parse_files(task_id: object, name: str, files: Any, problems: list[str]) -> None:
    if not isinstance(files, Mapping) or not all(isinstance(v, str) for v in files.values()):
        problems.append(f"task {task_id!r}: {name} must map relative paths to text")
        return
    for path in files:
        if not isinstance(path, str) or len(path) > 200 or not _FILE_PATH.match(path):
            problems.append(
                f"task {task_id!r}: {name} path {path!r} must be relative, without '..', made "
                "of letters, digits, '_', '.', '-' and '/'"
            )


def parse_agent(value: Any, where: str, problems: list[str]) -> None:
    """An agent is "oracle" or {command: [argv...], env: {NAME: value}}."""
    if value == ORACLE:
        return
    if not isinstance(value, Mapping) or set(value) - {"command", "env"}:
        problems.append(f"{where} must be 'oracle' or an object {{command, env}}")
        return
    command = value.get("command")
    if (
        not isinstance(command, list)
        or not 1 <= len(command) <= MAX_AGENT_ARGS
        or not all(isinstance(a, str) and a and "\0" not in a for a in command)
    ):
        problems.append(f"{where}.command must be a list of 1..{MAX_AGENT_ARGS} non-empty strings")
    env = value.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) for k, v in env.items()
    ):
        problems.append(f"{where}.env must map variable names to strings")
    elif reserved := sorted(k for k in env if k in AGENT_RESERVED_ENV or k.startswith("ROLLOUT_")):
        problems.append(f"{where}.env may not set {reserved}: the runner sets those")


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The test commands the grader's harness counts (rollout_worker/sandbox/episode.py
# `harness_plan`, which ships alone and cannot import this; a unit test holds the two alike).
PYTHON_FLAGS = frozenset(("-B", "-b", "-bb", "-u", "-O", "-OO", "-q", "-s", "-E"))
PYTHON_OPTIONS = frozenset(("-W", "-X"))


def countable(argv: list[Any]) -> bool:
    """Whether the grader can count what a test command ran (else: its exit status alone)."""
    if not argv or argv[0] not in ("python", "python3"):
        return False
    rest = list(argv[1:])
    while rest and str(rest[0]).startswith("-") and rest[0] != "-m":
        flag = rest.pop(0)
        if flag in PYTHON_OPTIONS and rest:
            rest.pop(0)
        elif flag not in PYTHON_FLAGS:
            return False
    if len(rest) >= 2 and rest[0] == "-m":
        return rest[1] in ("unittest", "pytest")
    return bool(rest) and str(rest[0]).endswith(".py")


def _oracle_problems(tasks: list[Any]) -> list[str]:
    """A task whose agent is the oracle needs the script the oracle runs."""
    return [
        f"task {task.get('id')!r}: the oracle agent needs solution/{SOLVE_SCRIPT}"
        for task in tasks
        if task.get("agent") == ORACLE and SOLVE_SCRIPT not in (task.get("solution") or {})
    ]


def _parse_tasks(value: Any, problems: list[str]) -> list[dict[str, Any]]:
    """Tasks are data: each one checked here, every problem listed."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        problems.append("tasks must be a list of task objects")
        return []
    if len(value) > MAX_TASKS:
        problems.append(f"{len(value)} tasks exceed the limit of {MAX_TASKS} per batch")
    size = len(orjson.dumps(value))
    if size > MAX_TASKS_BYTES:
        problems.append(
            f"tasks take {size} bytes encoded, above the {MAX_TASKS_BYTES} bytes a batch may carry "
            "(they travel in the batch's ConfigMap, which the API server caps at 1 MiB): split "
            "the task set into several batches or make the tasks smaller"
        )
    seen: set[str] = set()
    before = len(problems)
    for task in value:
        tid = task.get("id")
        unknown = sorted(set(task) - set(TASK_FIELDS))
        if unknown:
            problems.append(
                f"task {tid!r}: unknown fields {unknown}; allowed: {sorted(TASK_FIELDS)}"
            )
        if not isinstance(tid, str) or not _TASK_ID.match(tid):
            problems.append(
                f"task id {tid!r} must be 1-63 lower-case letters, digits, '-', '_', '.'"
            )
        elif tid in seen:
            problems.append(f"task id {tid!r} appears twice")
        else:
            seen.add(tid)
        if not isinstance(task.get("statement"), str) or not task.get("statement"):
            problems.append(f"task {tid!r}: statement must be non-empty text")
        _parse_files(tid, "files", task.get("files"), problems)
        if "test_files" in task:
            _parse_files(tid, "test_files", task["test_files"], problems)
        command = task.get("test_command")
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(a, str) for a in command)
        ):
            problems.append(f"task {tid!r}: test_command must be a non-empty list of strings")
        if "tests" in task:
            _parse_files(tid, "tests", task["tests"], problems)
        if "solution" in task:
            _parse_files(tid, "solution", task["solution"], problems)
        if "agent" in task:
            parse_agent(task["agent"], f"task {tid!r}: agent", problems)
        problems += _oracle_problems([task])
        if not isinstance(task.get("baseline", True), bool):
            problems.append(f"task {tid!r}: baseline must be true or false")
        if task.get("grade", "same") not in GRADES:
            problems.append(
                f"task {tid!r}: grade {task.get('grade')!r} is not one of {list(GRADES)}"
            )
        if task.get("reward", "all") not in REWARD_RULES:
            problems.append(
                f"task {tid!r}: reward {task.get('reward')!r} is not one of {list(REWARD_RULES)}"
            )
        elif (
            task.get("reward") == "fraction"
            and isinstance(command, list)
            and not countable(command)
        ):
            problems.append(
                f"task {tid!r}: reward fraction needs a test command the grader can count "
                "(python -m unittest, python -m pytest or python <script>.py): a command's own "
                "output is no count of what ran"
            )
        for name, default, top in (
            ("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS, MAX_DEADLINE_SECONDS),
            ("max_steps", DEFAULT_MAX_STEPS, MAX_STEPS),
            ("test_timeout_seconds", DEFAULT_TEST_TIMEOUT_SECONDS, MAX_DEADLINE_SECONDS),
        ):
            number = task.get(name, default)
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
                problems.append(f"task {tid!r}: {name} must be an integer within 1..{top}")
        workdir = task.get("workdir")
        if workdir is not None and (
            not isinstance(workdir, str)
            or not _WORKDIR.match(workdir)
            or workdir.split("/")[1] in _RESERVED_DIRS
            or any(part in (".", "..") for part in workdir.split("/"))
        ):
            problems.append(
                f"task {tid!r}: workdir {workdir!r} must be an absolute path of letters, digits, "
                f"'_', '.', '-', outside {sorted(_RESERVED_DIRS)}"
            )
        image = task.get("image")
        if image is not None and (not isinstance(image, str) or not _IMAGE.match(image)):
            problems.append(f"task {tid!r}: image {image!r} is not a valid image reference")
    if len(problems) > before:
        return []
    return [dict(t) for t in value]

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

from rollout_wire import request_checks
from rollout_wire.errors import InvalidSpec
from rollout_wire.field_table import Check, Field, ParseState, bounded, choice, matching
from rollout_wire.policy import PolicyEndpoint, parse_policy

# Re-exported: the batch's resources lived here before `rollout_wire.resources`.
from rollout_wire.resources import Resources as Resources
from rollout_wire.resources import parse_resources
from rollout_wire.states import GroupFilter

# Re-exported: a task's fields and limits lived here before `rollout_wire.task_spec`.
from rollout_wire.task_spec import (
    DEFAULT_TASK_TIME_LIMIT_SECONDS as DEFAULT_TASK_TIME_LIMIT_SECONDS,
)
from rollout_wire.task_spec import DEFAULT_TEST_TIMEOUT_SECONDS as DEFAULT_TEST_TIMEOUT_SECONDS
from rollout_wire.task_spec import (
    IMAGE_REFERENCE,
    MAX_DEADLINE_SECONDS,
    MAX_TASK_WARNING_CHARS,
    MAX_TASK_WARNINGS,
    parse_agent,
    parse_tasks,
)
from rollout_wire.task_spec import MAX_TASKS as MAX_TASKS
from rollout_wire.task_spec import MAX_TASKS_BYTES as MAX_TASKS_BYTES
from rollout_wire.task_spec import ORACLE as ORACLE
from rollout_wire.task_spec import REWARD_FILES as REWARD_FILES
from rollout_wire.task_spec import REWARD_RULES as REWARD_RULES
from rollout_wire.task_spec import SOLVE_SCRIPT as SOLVE_SCRIPT
from rollout_wire.task_spec import TASK_FIELDS as TASK_FIELDS
from rollout_wire.task_spec import Task as Task
from rollout_wire.task_spec import countable as countable

BACKENDS = ("local", "kubernetes")
ISOLATIONS = ("pod", "host")  # kubernetes: a Pod per episode, or sandboxes in host Pods
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

_BATCH_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def new_batch_id() -> str:
    return uuid.uuid4().hex[:16]


def is_batch_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and bool(_BATCH_ID.match(value))


@dataclass(frozen=True)
class BatchSpec:
    """One sampling round's request: `count` episodes, at most `parallelism` at a time."""

    batch_id: str
    count: int
    parallelism: int
    backend: str = "local"
    # Kubernetes: "pod" (a Pod per episode) or "host" (bubblewrap sandboxes in sandbox-host Pods).
    isolation: str = "pod"
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
    tasks: list[Task] = field(default_factory=list)
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
    # What loading the tasks warned of (a task.toml key let through by --allow-unknown-keys,
    # one not enforced here): said again in the report (`rollout_fields` fills it in).
    task_warnings: list[str] = field(default_factory=list)
    # Kubernetes: the Secret (in the batch's namespace) whose keys give the tasks' ${VAR}
    # templates their values (`TASK_FIELDS["env"]`); the local backend reads the worker's own
    # environment instead. Only the name travels, never a value.
    task_env_secret: str | None = None

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


DEMO_TASK_ID = "shipping-demo"
# Limits of the batch's own numbers (a task's: rollout_wire.task_spec).
MAX_SAMPLES_PER_TASK = 256
MAX_INFRA_RETRIES = 3
MAX_WARM_POOL = 256
PULL_POLICIES = ("IfNotPresent", "Never", "Always")
CAPACITY_CHECKS = ("error", "warn", "off")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


# -- the field parsers (the table: `_TABLE`, the checks across fields: request_checks) ----------
def _batch_id(request: ParseState) -> Any:
    batch_id = request.data.get("batch_id") or new_batch_id()
    if not is_batch_id(batch_id):
        request.problems.append(
            f"batch_id {batch_id!r} must be 1-40 lower-case letters, digits or '-', "
            "starting and ending with a letter or digit"
        )
    return batch_id


def _count(request: ParseState) -> int:
    """With tasks, the task set times samples_per_task; without, the demo's `count` samples
    of its one task (samples_per_task is then 1)."""
    data, tasks, samples = request.data, request["tasks"], request["samples_per_task"]
    if tasks:
        # A batch is the task set times samples_per_task; `count` may only repeat that.
        count = len(tasks) * samples
        if data.get("count") is not None and data.get("count") != count:
            request.problems.append(
                f"count {data.get('count')!r} disagrees with {len(tasks)} task(s) x "
                f"samples_per_task {samples} = {count}; leave count out with tasks"
            )
        return count
    if data.get("samples_per_task") not in (None, 1):
        request.problems.append(
            "samples_per_task needs tasks; the built-in demo runs `count` samples of its one task"
        )
    request.values["samples_per_task"] = 1
    return request.integer("count", 10)


def _parallelism(request: ParseState) -> int:
    """At most `count` at a time; the count's own bounds are reported here too."""
    count, max_episodes = request["count"], request.max_episodes
    if request.data.get("parallelism") is None:
        parallelism = count
    else:
        parallelism = request.integer("parallelism", count)
    if count < 1:
        request.problems.append(f"count must be at least 1, got {count}")
    elif max_episodes is not None and count > max_episodes:
        request.problems.append(
            f"count {count} exceeds the configured maximum of {max_episodes} episodes per "
            "batch (ROLLOUT_MAX_BATCH_EPISODES); split it into several batches"
        )
    elif not 1 <= parallelism <= count:
        request.problems.append(
            f"parallelism must satisfy 1 <= parallelism <= count ({count}), got {parallelism}"
        )
    return parallelism


def _submitted_at(request: ParseState) -> Any:
    submitted_at = request.data.get("submitted_at") or time.time()
    if isinstance(submitted_at, bool) or not isinstance(submitted_at, (int, float)):
        request.problems.append(
            f"submitted_at must be a unix time in seconds, got {submitted_at!r}"
        )
        return 0.0
    return submitted_at


def _labels(request: ParseState) -> Any:
    labels = request.data.get("labels", {}) or {}
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and _LABEL_KEY.match(k) and isinstance(v, str) and len(v) <= 256
        for k, v in labels.items()
    ):
        request.problems.append(
            "labels must map short names ([A-Za-z0-9_.-]) to strings (<= 256 chars)"
        )
        return {}
    return labels


def _task_warnings(request: ParseState) -> Any:
    said = request.data.get("task_warnings", [])
    if (
        not isinstance(said, list)
        or not all(isinstance(m, str) and len(m) <= MAX_TASK_WARNING_CHARS for m in said)
        or len(said) > MAX_TASK_WARNINGS
    ):
        request.problems.append(
            f"task_warnings must be a list of at most {MAX_TASK_WARNINGS} texts of at most "
            f"{MAX_TASK_WARNING_CHARS} characters"
        )
        return []
    return list(said)


def _policy_version(request: ParseState) -> Any:
    version = request.data.get("policy_version")
    if version is not None and (not isinstance(version, str) or not 0 < len(version) <= 128):
        request.problems.append(
            f"policy_version must be text of 1..128 characters, got {version!r}"
        )
        return None
    return version


def _agent(request: ParseState) -> Any:
    agent = request.data.get("agent")
    if agent is not None:
        parse_agent(agent, "agent", request.problems)
        if not request["tasks"]:
            request.problems.append("agent needs tasks: the built-in demo has its fixed action")
    return agent


def _agent_env(request: ParseState) -> Any:
    agent_env = request.data.get("agent_env")
    if agent_env is not None and (
        not isinstance(agent_env, str)
        or not agent_env.startswith("/")
        or ".." in agent_env.split("/")
        or len(agent_env) > 1024
    ):
        request.problems.append(f"agent_env must be an absolute directory path, got {agent_env!r}")
        return None
    return agent_env


_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _task_env_secret(request: ParseState) -> Any:
    name = request.data.get("task_env_secret")
    if name is not None and (not isinstance(name, str) or not _SECRET_NAME.match(name)):
        request.problems.append(
            f"task_env_secret must be a Kubernetes Secret name (lower-case letters, digits, "
            f"'-', '.'; at most 253), got {name!r}"
        )
        return None
    return name


def _node_selector(request: ParseState) -> Any:
    selector = request.data.get("node_selector") or {}
    if not isinstance(selector, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        request.problems.append("node_selector must map label names to string values")
        return {}
    return selector


def _tolerations(request: ParseState) -> Any:
    tolerations = request.data.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(
        isinstance(t, Mapping) and set(t) <= _TOLERATION_KEYS for t in tolerations
    ):
        request.problems.append(
            f"tolerations must be a list of objects with keys from {sorted(_TOLERATION_KEYS)}"
        )
        return []
    return tolerations


def _keep_run(request: ParseState) -> Any:
    keep = request.data.get("keep_run", False)
    if not isinstance(keep, bool):
        request.problems.append(f"keep_run must be true or false, got {keep!r}")
        return False
    return keep


def _policy(request: ParseState) -> PolicyEndpoint | None:
    raw = request.data.get("policy")
    if isinstance(raw, PolicyEndpoint):
        raw = raw.to_dict()
    return parse_policy(raw, request.problems)


def _is_image(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 255 and bool(IMAGE_REFERENCE.match(value))


def _is_runtime(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 253 and bool(_DNS_SUBDOMAIN.match(value))


def _groups(request: ParseState) -> int:
    """The batch's groups: one per task (the demo's one)."""
    return len(request["tasks"]) if request["tasks"] else 1


# Every field of BatchSpec, read and checked in this order (a problem list keeps it), with the
# checks across fields where the fields they read are known.
_TABLE: tuple[Field | Check, ...] = (
    Field("batch_id", _batch_id, str),
    Field("tasks", lambda request: parse_tasks(request.data.get("tasks"), request.problems)),
    Field(
        "samples_per_task",
        bounded(
            "samples_per_task",
            1,
            1,
            MAX_SAMPLES_PER_TASK,
            lambda _, v: f"samples_per_task must be within 1..{MAX_SAMPLES_PER_TASK}, got {v}",
            fallback=1,
        ),
    ),
    Field("count", _count),
    Field("parallelism", _parallelism),
    Field("backend", choice("backend", "local", BACKENDS), str),
    Field("isolation", choice("isolation", "pod", ISOLATIONS), str),
    Check(request_checks.host_only_on_kubernetes),
    Field(
        "image",
        matching(
            "image",
            DEFAULT_IMAGE,
            _is_image,
            "image {value!r} is not a valid image reference like 'python:3.12-alpine' or "
            "'registry.example.com/team/python:3.12@sha256:<64 hex>'",
        ),
        str,
    ),
    Field(
        "runtime",
        matching(
            "runtime",
            DEFAULT_RUNTIME,
            _is_runtime,
            "runtime {value!r} is not a valid RuntimeClass name (lower-case DNS subdomain, "
            "e.g. 'cube' or 'runc')",
        ),
        str,
    ),
    Field(
        "deadline_seconds",
        bounded(
            "deadline_seconds",
            DEFAULT_DEADLINE_SECONDS,
            1,
            MAX_DEADLINE_SECONDS,
            lambda _, v: f"deadline_seconds must be within 1..{MAX_DEADLINE_SECONDS}, got {v}",
        ),
    ),
    Field(
        "episode_timeout_seconds",
        bounded(
            "episode_timeout_seconds",
            lambda r: min(DEFAULT_EPISODE_TIMEOUT_SECONDS, r["deadline_seconds"]),
            1,
            lambda r: max(r["deadline_seconds"], 1),
            lambda r, v: (
                f"episode_timeout_seconds must be within 1..deadline_seconds "
                f"({r['deadline_seconds']}), got {v} (rollout run: raise --deadline or lower "
                "--episode-timeout)"
            ),
        ),
    ),
    Field("resources", parse_resources),
    Field("action", choice("action", "fix", ACTIONS), str),
    Field("submitted_at", _submitted_at, float),
    Field("labels", _labels, dict),
    Field(
        "infra_retries",
        bounded(
            "infra_retries",
            0,
            0,
            MAX_INFRA_RETRIES,
            lambda _, v: f"infra_retries must be within 0..{MAX_INFRA_RETRIES}, got {v}",
            fallback=0,
        ),
    ),
    Field(
        "warm_pool",
        bounded(
            "warm_pool",
            0,
            0,
            MAX_WARM_POOL,
            lambda _, v: f"warm_pool must be within 0..{MAX_WARM_POOL}, got {v}",
            fallback=0,
        ),
    ),
    Field(
        "max_consecutive_infra_failures",
        bounded(
            "max_consecutive_infra_failures",
            DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES,
            0,
            MAX_EPISODES_EVER,
            lambda _, v: (
                f"max_consecutive_infra_failures must be within 0..{MAX_EPISODES_EVER} "
                f"(0: never halt), got {v}"
            ),
            fallback=DEFAULT_MAX_CONSECUTIVE_INFRA_FAILURES,
        ),
    ),
    Field(
        "groups_wanted",
        bounded(
            "groups_wanted",
            0,
            0,
            _groups,
            lambda r, v: (
                f"groups_wanted must be within 0..{_groups(r)} (the batch's groups: one per "
                f"task; 0: no quota), got {v}"
            ),
            fallback=0,
        ),
    ),
    Field(
        "group_filter",
        choice(
            "group_filter",
            GroupFilter.ANY,
            tuple(f.value for f in GroupFilter),
            fallback=GroupFilter.ANY,
        ),
        GroupFilter,
    ),
    Field("policy_version", _policy_version),
    Field("agent", _agent),
    Field("agent_env", _agent_env),
    Field("task_warnings", _task_warnings),
    Field("task_env_secret", _task_env_secret),
    Check(request_checks.fresh_grade_in_the_batch_image),
    Check(request_checks.agent_env_only_local),
    Check(request_checks.warm_pool_without_workdir),
    Check(request_checks.steps_where_they_run),
    Field("image_pull_policy", choice("image_pull_policy", "IfNotPresent", PULL_POLICIES), str),
    Field("capacity_check", choice("capacity_check", "error", CAPACITY_CHECKS), str),
    Field("node_selector", _node_selector, dict),
    Field("tolerations", _tolerations, lambda tolerations: [dict(t) for t in tolerations]),
    Field("keep_run", _keep_run),
    Field("policy", _policy),
    Check(request_checks.policy_address_on_kubernetes),
    Check(request_checks.tasks_grouped_by_image),
    Check(request_checks.warm_pool_one_shape),
    Check(request_checks.agent_into_tasks),
    Check(request_checks.tasks_have_a_policy),
    Check(request_checks.task_limits_within_episode),
)
FIELD_NAMES = tuple(entry.name for entry in _TABLE if isinstance(entry, Field))


def parse_spec(data: Mapping[str, Any], *, max_episodes: int | None) -> BatchSpec:
    """Validate a batch request (a JSON object) and return it as a BatchSpec.

    `max_episodes` is the deployment's limit (ROLLOUT_MAX_BATCH_EPISODES); None where it is
    not known (a trainer's process), the workers then enforce it.
    Raises InvalidSpec listing every problem, each saying what was wrong and what is allowed.
    """
    if not isinstance(data, Mapping):
        raise InvalidSpec([f"a batch request must be a JSON object, got {type(data).__name__}"])
    request = ParseState(data, max_episodes)
    known = {f.name for f in fields(BatchSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        request.problems.append(f"unknown fields {unknown}; allowed: {sorted(known)}")
    for entry in _TABLE:
        if isinstance(entry, Field):
            request.values[entry.name] = entry.parse(request)
        else:
            entry.check(request)
    if request.problems:
        raise InvalidSpec(request.problems)
    stored = {e.name: e.store(request[e.name]) for e in _TABLE if isinstance(e, Field)}
    return BatchSpec(**stored)

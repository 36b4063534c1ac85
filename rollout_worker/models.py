"""Wire models shared by the trainer and the workers: batch requests, episode rows, reports.

Everything here is pure: parsing validates and reports every problem at once, before any
side effect, so bad input never creates anything.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeGuard

from rollout_worker.errors import InvalidSpec
from rollout_worker.quantities import parse_cpu, parse_memory

BACKENDS = ("local", "kubernetes")
# The episode's action: `fix` is the guide's deterministic stand-in for an agent; `none`
# leaves the bug in place (reward 0, the episode fails); `hang` never finishes (exercises
# deadlines).
ACTIONS = ("fix", "none", "hang")

DEFAULT_IMAGE = "python:3.12-alpine"
DEFAULT_RUNTIME = "cube"
DEFAULT_DEADLINE_SECONDS = 240
DEFAULT_EPISODE_TIMEOUT_SECONDS = 120
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


# The headline numbers of a report, in the order people read them (CLI tables, summaries).
REPORT_METRICS = (
    "episodes",
    "successful_episodes",
    "failed_episodes",
    "lost_episodes",
    "reward_sum",
    "parallelism",
    "batch_to_all_ready_seconds",
    "pod_to_ready_p50_seconds",
    "pod_to_ready_p95_seconds",
    "pod_to_ready_max_seconds",
    "batch_to_all_rewards_seconds",
    "job_complete_seconds",
    "client_job_complete_seconds",
)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int_field(data: Mapping[str, Any], name: str, default: int, problems: list[str]) -> int:
    """The integer at `name`; a non-integer is reported and replaced by `default`."""
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{name} must be an integer, got {value!r}")
        return default
    return value


def parse_spec(data: Mapping[str, Any], *, max_episodes: int) -> BatchSpec:
    """Validate a batch request (a JSON object) and return it as a BatchSpec.

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

    count = _int_field(data, "count", 10, problems)
    parallelism = (
        count
        if data.get("parallelism") is None
        else _int_field(data, "parallelism", count, problems)
    )
    if count < 1:
        problems.append(f"count must be at least 1, got {count}")
    elif count > max_episodes:
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
            f"got {episode_timeout}"
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

    placement = _parse_placement(data, problems)

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


def _parse_resources(data: Any, problems: list[str]) -> Resources:
    if isinstance(data, Resources):
        return data
    if not isinstance(data, Mapping):
        problems.append(f"resources must be an object, got {data!r}")
        return Resources()
    allowed = {f.name for f in fields(Resources)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        problems.append(f"unknown resources fields {unknown}; allowed: {sorted(allowed)}")
        return Resources()
    res = Resources(**{k: str(v) for k, v in data.items()})
    try:
        cpu_req, cpu_lim = parse_cpu(res.cpu_request), parse_cpu(res.cpu_limit)
        mem_req, mem_lim = parse_memory(res.memory_request), parse_memory(res.memory_limit)
    except ValueError as exc:
        problems.append(f"resources: {exc}")
        return res
    if cpu_req <= 0 or mem_req <= 0:
        problems.append("resources: requests must be greater than zero")
    if cpu_req > cpu_lim:
        problems.append(
            f"resources: cpu_request {res.cpu_request} exceeds cpu_limit {res.cpu_limit}"
        )
    if mem_req > mem_lim:
        problems.append(
            f"resources: memory_request {res.memory_request} exceeds "
            f"memory_limit {res.memory_limit}"
        )
    if mem_lim < 32 * 2**20:
        problems.append(
            f"resources: memory_limit {res.memory_limit} is below 32Mi; Python cannot start in less"
        )
    return res


def spec_from_dict(data: Mapping[str, Any]) -> BatchSpec:
    """Rebuild a spec that was validated before (from a receipt); no limits re-applied."""
    values = dict(data)
    values["resources"] = Resources(**values.get("resources", {}))
    return BatchSpec(**values)


@dataclass
class EpisodeObservation:
    """What a backend saw of one episode's sandbox (a Pod, or a local process)."""

    index: int
    episode_id: str
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    node: str | None = None
    image_id: str | None = None
    exit_code: int | None = None
    restart_count: int = 0
    reason: str | None = None
    timing: dict[str, float | None] = field(default_factory=dict)
    termination_message: str | None = None

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeObservation:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class EpisodeRow:
    """One episode's validated outcome, as the trainer and results.json see it."""

    index: int
    pod: str
    status: str  # ok | failed | lost
    errors: list[str] = field(default_factory=list)
    reward: int = 0
    baseline_exit: int | None = None
    tests_exit: int | None = None
    exit_code: int | None = None
    restart_count: int = 0
    phase: str | None = None
    node: str | None = None
    image_id: str | None = None
    created_at: float | None = None
    ready_at: float | None = None
    reward_at: float | None = None
    finished_at: float | None = None
    pod_to_ready_seconds: float | None = None
    batch_to_ready_seconds: float | None = None
    batch_to_reward_seconds: float | None = None
    timing: dict[str, float | None] = field(default_factory=dict)
    collected_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeRow:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

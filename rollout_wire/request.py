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

from rollout_wire.errors import InvalidSpec

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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchSpec:
        """Decode a spec validated before (a stored receipt); no limits are re-applied."""
        values = dict(data)
        values["resources"] = Resources(**values.get("resources", {}))
        return cls(**values)


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

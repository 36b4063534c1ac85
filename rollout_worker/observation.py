"""What a backend saw of one episode's sandbox: the input of validation."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson

# The agent runner's exit status for an infrastructure failure (sandbox/runner/errors.py uses the
# same number): the only exit status the batch's retry budget (`infra_retries`) runs again.
EXIT_INFRASTRUCTURE = 4

# The reason of an episode ended for writing past its own disk limit (the batch's
# `resources.storage_limit`): on Kubernetes the kubelet's eviction for a container's, the
# Pod's or an emptyDir's own limit, locally the supervisor's measurement of its folders. The
# episode's doing: validation makes it an `episode` failure (reward 0, never retried).
STORAGE_LIMIT_REASON = "StorageLimitExceeded"
# The kubelet's messages for those evictions (pkg/kubelet/eviction/helpers.go:
# emptyDirMessageFmt, podEphemeralStorageMessageFmt, containerEphemeralStorageMessageFmt).
# A node-pressure eviction ("The node was low on resource: ephemeral-storage. ...", with a
# DisruptionTarget condition) is none of them: it stays `Evicted`, an infrastructure failure.
_OWN_DISK_EVICTIONS = (
    re.compile(r'^Usage of EmptyDir volume "[^"]*" exceeds the limit "[^"]*"\.\s*$'),
    re.compile(
        r"^Pod ephemeral local storage usage exceeds the total limit of containers \S+\.\s*$"
    ),
    re.compile(r'^Container \S+ exceeded its local ephemeral storage limit "[^"]*"\.\s*$'),
)


def own_disk_eviction(status: Mapping[str, object]) -> str | None:
    """The episode's end reason when a Pod's status says the kubelet evicted it for its own
    disk use (STORAGE_LIMIT_REASON and the kubelet's message), else None. Never for a Pod
    with a DisruptionTarget condition (the node's pressure, a preemption)."""
    message = status.get("message")
    if status.get("reason") != "Evicted" or not isinstance(message, str):
        return None
    conditions = status.get("conditions")
    if any(
        isinstance(c, Mapping) and c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for c in (conditions if isinstance(conditions, list) else [])
    ):
        return None
    if not any(pattern.match(message) for pattern in _OWN_DISK_EVICTIONS):
        return None
    return f"{STORAGE_LIMIT_REASON}: {message.strip()}"


def over_storage_limit(reason: str | None) -> bool:
    """Whether an episode's end reason says it wrote past its own disk limit."""
    return (reason or "").startswith(STORAGE_LIMIT_REASON)


@dataclass
class EpisodeObservation:
    """One episode's sandbox (a Pod, or a local process) as its backend last saw it."""

    index: int
    episode_id: str  # becomes EpisodeRow.pod
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
    # Earlier attempts of this episode, each ended by an infrastructure failure and run again
    # in a fresh sandbox under the retry budget (see `attempt_summary`); oldest first.
    retried: list[dict[str, Any]] = field(default_factory=list)
    # The runner said its episode is ready (Kubernetes: the startup probe on its ready marker
    # passed). Progress only: validation reads the events themselves.
    ready: bool = False
    # Chat completions the host answered this episode's sandbox with a 200, counted outside it
    # (the local backend's policy socket): the runner's record can be checked against it, since
    # an agent may reach the policy without the runner. None: not counted by this backend.
    policy_completions: int | None = None
    # The containers whose logs, in this order, make the episode's log (Kubernetes: an agent's
    # init container before the grading one, when the batch grades apart). Empty: the one.
    log_containers: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeObservation:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def attempt_summary(obs: EpisodeObservation) -> dict[str, Any]:
    """What a retried attempt leaves in its episode's row: which sandbox, how it ended, why
    (the cause the runner wrote to its termination message, when it wrote one)."""
    cause = obs.reason
    if obs.termination_message:
        try:
            message = orjson.loads(obs.termination_message)
        except orjson.JSONDecodeError:
            message = None
        if isinstance(message, dict) and message.get("cause"):
            cause = str(message["cause"])
    return {
        "episode_id": obs.episode_id,
        "exit_code": obs.exit_code,
        "reason": obs.reason,
        "cause": cause,
        "finished_at": obs.finished_at,
    }

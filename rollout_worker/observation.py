"""What a backend saw of one episode's sandbox: the input of validation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


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

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpisodeObservation:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

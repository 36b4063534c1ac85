"""One episode under validation: what the backend saw, its log parsed once, the events each
rule reads, and the row the rules fill in."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from rollout_wire.rows import EpisodeRow
from rollout_wire.states import EpisodeStatus, EventKind
from rollout_wire.trajectory import parse_events
from rollout_worker.observation import EpisodeObservation

# The `ready` event's `mode`: the runner's own loop (`agent`), an agent command whose chat
# completions the runner's proxy recorded (`command`), the task's solution as that command
# (`oracle`); `grade` is the grader's sandbox of a `grade: fresh` episode.
REAL_MODES = ("agent", "command", "oracle")
COMMAND_MODES = ("command", "oracle")
GRADE_MODE = "grade"

Event = dict[str, Any]


def number(event: Event | None, key: str) -> float | None:
    """The event's numeric field (a bool is no number); None when absent or not a number."""
    value = event.get(key) if event is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Episode:
    """The context every rule takes. The single events (`ready`, `reward`, ...) are None
    unless the log has exactly the one the rules may read; the lists keep every event of a
    kind, for the rules that count them."""

    observation: EpisodeObservation
    origin: float  # the run's creation time (Job created)
    row: EpisodeRow
    events: list[Event]
    line_problems: list[str]
    by_kind: dict[str, list[Event]] = field(default_factory=dict)
    ready: Event | None = None  # the (agent's) sandbox's ready event
    reward: Event | None = None
    stale: Event | None = None
    grade_pending: Event | None = None
    grader_ready: Event | None = None  # the grader sandbox's ready event (grade: fresh)
    error: Event | None = None  # the first error event

    @classmethod
    def of(cls, observation: EpisodeObservation, log: str, origin: float) -> Episode:
        events, problems = parse_events(log)
        episode = cls(observation, origin, _new_row(observation), events, problems)
        for event in events:
            episode.by_kind.setdefault(event["event"], []).append(event)
        episode._pick_events()
        return episode

    def all(self, kind: EventKind) -> list[Event]:
        return self.by_kind.get(kind, [])

    def _pick_events(self) -> None:
        readies, rewards = self.all(EventKind.READY), self.all(EventKind.REWARD)
        stales, pendings = self.all(EventKind.STALE), self.all(EventKind.GRADE_PENDING)
        self.ready = readies[0] if len(readies) == self.readies_wanted else None
        # A stale event stands in for the reward, once, in a real rollout; anything else with
        # one (a reward too, two of them, the demo) is a tampered-with log.
        alone = len(stales) == 1 and not rewards and not pendings
        self.stale = stales[0] if alone and self.is_real else None
        self.reward = rewards[0] if len(rewards) == 1 else None
        self.grade_pending = pendings[0] if len(pendings) == 1 and self.is_real else None
        if self.grade_pending is not None and self.ready is not None:
            self.grader_ready = readies[1]
        self.error = next(iter(self.all(EventKind.ERROR)), None)

    @property
    def errors(self) -> list[str]:
        return self.row.errors

    @property
    def episode_id(self) -> str:
        return self.observation.episode_id

    @property
    def readies_wanted(self) -> int:
        # A fresh-graded episode has a ready event from each of its two sandboxes.
        return 2 if self.all(EventKind.GRADE_PENDING) else 1

    @property
    def mode(self) -> Any:
        return self.ready.get("mode") if self.ready is not None else None

    @property
    def is_real(self) -> bool:
        """A real rollout (a task and a policy or agent), not the guide's demo."""
        return self.mode in REAL_MODES

    @property
    def is_command(self) -> bool:
        """An agent command ran (or the oracle): its steps are recorded exchanges."""
        return self.mode in COMMAND_MODES

    @property
    def steps(self) -> list[Event]:
        return self.all(EventKind.STEP)

    @property
    def summary(self) -> Event | None:
        """Where the baseline, the steps and the agent's fields are: the first sandbox's last
        word (grade_pending when graded fresh, else the reward)."""
        return self.grade_pending if self.grade_pending is not None else self.reward

    @property
    def outcome(self) -> Event | None:
        """The event that ends the agent's part: grade_pending, the reward, or stale."""
        return self.summary if self.summary is not None else self.stale


def _new_row(observation: EpisodeObservation) -> EpisodeRow:
    return EpisodeRow(
        index=observation.index,
        pod=observation.episode_id,
        status=EpisodeStatus.OK,
        exit_code=observation.exit_code,
        restart_count=observation.restart_count,
        phase=observation.phase,
        node=observation.node,
        image_id=observation.image_id,
        created_at=observation.created_at,
        finished_at=observation.finished_at,
        timing=dict(observation.timing),
        collected_at=time.time(),
        retried=[dict(attempt) for attempt in observation.retried],
    )


def check_names_the_episode(episode: Episode, ready: Event, event: Event, label: str) -> None:
    """An event after `ready` must name the same episode, task and group (`label`: how the
    errors name the event)."""
    if event.get("episode_id") != episode.episode_id:
        episode.errors.append(
            f"{label} names episode {event.get('episode_id')!r}, but the sandbox is "
            f"{episode.episode_id!r}"
        )
    for key in ("task_id", "group_id"):
        if event.get(key) != ready.get(key):
            episode.errors.append(
                f"{label} names {key} {event.get(key)!r}, the episode's is {ready.get(key)!r}"
            )

"""One training sample per episode, from a collected group: the episode's token view
(rollout_wire.tokens) with its reward and status, in the shape every adapter maps from.

An episode whose turns were not append-only (a `stepwise` view) gives one sample per turn:
each turn's prompt and completion, the episode's reward on each (SkyRL's step-wise mode and
slime take them so; a trainer that wants one sequence per episode takes `last_turn`). An
episode that is no sample (an infrastructure failure, lost, never ran) has `reward` None and
no ids: trainers must leave it out of group baselines, never score it 0. A withdrawn one
(aborted by the quota, stale) is `aborted`: slime's ABORTED, TRL's unscorable."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rollout_wire.tokens import AVAILABLE, SEQUENCE
from trainer_stub.client import RolloutClient

ABORTED_STATUSES = ("aborted", "stale")


@dataclass(frozen=True)
class TrainingSample:
    """One sequence to learn from (or a placeholder for an episode that is none)."""

    task_id: str
    sample: int
    index: int
    reward: float | None  # None: no sample (infrastructure failure, lost, aborted)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    # 1 for the model's ids, 0 for the environment's (tool output between turns).
    response_mask: list[int] = field(default_factory=list)
    # The sampling engine's log-probability of each response id (0.0 on environment ids).
    response_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[Any] = field(default_factory=list)  # per model turn
    turns: int = 0
    aborted: bool = False
    status: str = "ok"
    # Why there are no ids (the view's reason, or the row's failure), when there are none.
    missing: str | None = None
    turn: int | None = None  # for one turn of a stepwise episode: which (1-based)
    episode_id: str = ""  # the sandbox's name (the policy saw it in its request path)

    @property
    def usable(self) -> bool:
        """Whether a trainer may learn from it: a reward and ids."""
        return self.reward is not None and bool(self.response_ids)


def samples_of_row(row: Mapping[str, Any]) -> list[TrainingSample]:
    """The training samples of one episode row as `sampled_groups` gives it (with `tokens`)."""
    base = TrainingSample(
        task_id=str(row.get("task_id")),
        sample=int(row.get("sample") or 0),
        index=int(row.get("index") or 0),
        reward=None,
        episode_id=str(row.get("pod") or ""),
    )
    status = str(row.get("status"))
    if status != "ok":
        why = row.get("failure_cause") or status
        return [
            replace(
                base,
                aborted=status in ABORTED_STATUSES,
                status=status,
                missing=str(why),
            )
        ]
    reward = float(row.get("reward") or 0.0)
    view = row.get("tokens")
    if not isinstance(view, Mapping) or view.get("tokens") != AVAILABLE:
        why = view.get("reason") if isinstance(view, Mapping) else "no token view was stored"
        return [replace(base, status=status, missing=str(why))]

    def sequence(part: Mapping[str, Any], versions: list[Any], turn: int | None) -> TrainingSample:
        return replace(
            base,
            reward=reward,
            prompt_ids=list(part["prompt_ids"]),
            response_ids=list(part["response_ids"]),
            response_mask=list(part["response_mask"]),
            response_logprobs=list(part["response_logprobs"]),
            policy_versions=versions,
            turns=len(versions),
            turn=turn,
        )

    if view.get("layout") == SEQUENCE:
        return [sequence(view, [t.get("policy_version") for t in view["turns"]], None)]
    return [
        sequence(part, [part.get("policy_version")], number)
        for number, part in enumerate(view["samples"], 1)
    ]


def last_turn(samples: Sequence[TrainingSample]) -> TrainingSample:
    """One sample per episode: the sequence, or a stepwise episode's last turn."""
    return samples[-1]


def submit_episodes(
    client: RolloutClient, request: Mapping[str, Any], task_ids: Sequence[str], samples: int
) -> Any:
    """Submit one batch of the request's tasks `task_ids` (in that order, each once) x
    `samples`, with the request's other fields: the client's submission."""
    tasks = {str(t["id"]): t for t in request["tasks"]}
    unknown = sorted(set(task_ids) - set(tasks))
    if unknown:
        raise ValueError(f"tasks {unknown[:3]} are not in this request")
    chosen = [tasks[t] for t in dict.fromkeys(task_ids)]
    fields = {k: v for k, v in request.items() if k not in ("tasks", "samples_per_task")}
    if isinstance(fields.get("parallelism"), int):
        # The request's parallelism is a ceiling: a step that asks fewer episodes runs them all.
        fields["parallelism"] = max(1, min(fields["parallelism"], len(chosen) * samples))
    return client.submit(**fields, tasks=chosen, samples_per_task=samples)


def run_episodes(
    client: RolloutClient,
    request: Mapping[str, Any],
    task_ids: Sequence[str],
    samples: int,
    timeout: float,
) -> tuple[str, dict[tuple[str, int], list[TrainingSample]]]:
    """One batch of the request's tasks `task_ids` (in that order, each once) x `samples`,
    waited for: (its batch id, each episode's training samples by (task id, sample))."""
    submission = submit_episodes(client, request, task_ids, samples)
    episodes: dict[tuple[str, int], list[TrainingSample]] = {}
    for _, rows in client.sampled_groups(submission.batch_id, timeout):
        for row in rows:
            found = samples_of_row(row)
            episodes[(found[0].task_id, found[0].sample)] = found
    return submission.batch_id, episodes


def group_samples(rows: Iterable[Mapping[str, Any]]) -> list[list[TrainingSample]]:
    """Per episode of a group (in sample order), its training samples."""
    return [samples_of_row(row) for row in rows]

"""Turn what a backend saw of an episode (status + log) into a validated EpisodeRow.

Pure functions. Every rule of the guide is checked and every violation is listed on the row:
an episode is `ok` only when all of them hold, and a row that is not ok never carries reward 1.
A real rollout the runner stopped because its policy moved on (a well-formed `stale` event in
place of the reward, every other rule holding) is `stale`: withdrawn, reward 0, no failure.

Real rollouts come in three modes (the `ready` event's `mode`): `agent` (the runner's own
loop), `command` (an agent command whose chat completions the runner's proxy recorded as
exchange steps, then an `agent_exit` event) and `oracle` (the task's solution as the agent
command: `agent_exit`, no steps). A `grade: fresh` episode's log is two sandboxes' logs one
after the other: the agent's, ending with `grade_pending`, then the grader's (`ready` with mode
`grade`, then `reward`).

The rules (`RULES`) each take the episode (`episode.Episode`: the observation, the log parsed
once, the events the rules read, the row) and list what they find on the row; `rules` holds
the log's structure, `grading` the reward and the agent, `cost` the ledger and timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollout_wire.rows import EpisodeRow
from rollout_wire.states import EpisodeStatus, FailureKind
from rollout_wire.trajectory import parse_events
from rollout_worker.observation import EpisodeObservation, over_storage_limit
from rollout_worker.validation import cost, grading, rules
from rollout_worker.validation.cost import episode_cost, sanitize_cost
from rollout_worker.validation.episode import Episode

__all__ = [
    "INFRASTRUCTURE_REASONS",
    "RULES",
    "episode_cost",
    "failure_kind",
    "lost_row",
    "parse_events",
    "sanitize_cost",
    "validate_episode",
]

# In this order: a row lists its problems in the order the rules found them, and a later
# rule reads what an earlier one put on the row (the reward's time, the agent's seconds, the
# cost).
RULES: tuple[Callable[[Episode], None], ...] = (
    rules.sandbox_ended_cleanly,
    rules.log_lines_are_events,
    rules.stale_ends_only_a_real_rollout,
    rules.one_ready_and_one_reward,
    rules.grade_pending_ends_only_a_real_rollout,
    rules.fresh_grading_in_order,
    rules.events_name_the_episode,
    rules.ready_says_what_ran,
    rules.no_error_event,
    grading.reward_and_baseline,
    rules.steps_name_policy_versions,
    rules.stale_arithmetic_holds,
    rules.steps_in_order,
    grading.agent_command_recorded,
    rules.events_have_timestamps,
    rules.times_in_order,
    rules.termination_message_agrees,
    cost.timings_from_stamps,
    cost.cost_from_ledgers,
    grading.completions_all_recorded,
)


def validate_episode(obs: EpisodeObservation, log: str, origin: float) -> EpisodeRow:
    """Validate one finished episode. `origin` is the run's creation time (Job created)."""
    episode = Episode.of(obs, log, origin)
    for rule in RULES:
        rule(episode)
    _conclude(episode)
    return episode.row


def _conclude(episode: Episode) -> None:
    """The row's status from what the rules found: failed (reward 0) with its kind and cause,
    stale (withdrawn), or ok as it stands."""
    row, failure, stale = episode.row, episode.error, episode.stale
    if row.errors:
        row.status = EpisodeStatus.FAILED
        row.reward = 0  # a failed episode never hands the trainer a reward
        row.failure_kind = failure_kind(episode.observation, episode.ready, failure)
        row.failure_cause = (
            str(failure.get("cause"))
            if failure is not None and failure.get("cause")
            else row.errors[0]
        )
    elif stale is not None:
        # Withdrawn, not failed: no failure kind, and no reward (the tests never ran).
        row.status = EpisodeStatus.STALE
        row.reward = 0
        row.failure_cause = (
            f"stale: first turn at version {stale['first_version']}, policy at "
            f"{stale['version']} (max lag {stale['max_policy_lag']})"
        )


# The backend's reasons that say the sandbox was ended from outside (deadlines, a stop, a lost
# supervisor or sandbox host, an evicted or unschedulable Pod): never the policy's doing.
INFRASTRUCTURE_REASONS = (
    "DeadlineExceeded",
    "Stopped",
    "SupervisorLost",
    "HostLost",
    # A host's sandbox killed because its lease went to another host: fencing drops its end,
    # and were one ever written, it would be no sample of the policy.
    "LeaseLost",
    "Evicted",
    "BackoffLimitExceeded",
    "Unschedulable",
    "ContainerCannotRun",
    "StartError",
)


def failure_kind(
    obs: EpisodeObservation, ready: dict[str, Any] | None, error: dict[str, Any] | None
) -> FailureKind:
    """`infrastructure` when the row is no sample of the policy (the runner said so, the
    sandbox never got ready, or it was ended from outside); else `episode`. An episode ended
    for writing past its own disk limit is `episode` whatever its log kept (an evicted Pod's
    logs may be gone with its containers)."""
    if over_storage_limit(obs.reason):
        return FailureKind.EPISODE
    if error is not None:
        infrastructure = error.get("kind") == FailureKind.INFRASTRUCTURE
        return FailureKind.INFRASTRUCTURE if infrastructure else FailureKind.EPISODE
    if ready is None or (obs.reason or "") in INFRASTRUCTURE_REASONS:
        return FailureKind.INFRASTRUCTURE
    return FailureKind.EPISODE


def lost_row(
    index: int, episode_id: str, reason: str, obs: EpisodeObservation | None
) -> EpisodeRow:
    """A row for an episode that never produced a usable outcome before the deadline."""
    row = EpisodeRow(
        index=index,
        pod=episode_id,
        status=EpisodeStatus.LOST,
        errors=[reason],
        collected_at=time.time(),
        failure_kind=FailureKind.INFRASTRUCTURE,
        failure_cause=reason,
    )
    if obs is not None:
        row.phase, row.node, row.created_at = obs.phase, obs.node, obs.created_at
        row.exit_code, row.restart_count = obs.exit_code, obs.restart_count
        row.retried = [dict(attempt) for attempt in obs.retried]
    return row

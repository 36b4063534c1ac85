"""The rules of how an episode was graded and what its agent did: the reward against its rule,
the baseline, the grader's own account (graded_by, grade_cause), an agent command's recorded
exchanges and its agent_exit, and the policy completions no step recorded."""

from __future__ import annotations

from typing import Any

from rollout_wire.rows import MAX_FILE_REWARD, EpisodeRow
from rollout_wire.states import EventKind, GradeCause, GradedBy
from rollout_worker.validation.artifacts import artifacts_refused
from rollout_worker.validation.episode import (
    Episode,
    Event,
    check_names_the_episode,
    finite,
    number,
)
from rollout_worker.validation.steps import expected_agent_exits, step_rewards

# How the runner marks a message list or response it left out (too large to carry).
_MARKER_KEYS = {"omitted_bytes", "sha256"}


def reward_and_baseline(episode: Episode) -> None:
    """The reward event's fields onto the row, the reward held to its rule (the demo's: 1),
    and a baseline that ran must have failed."""
    reward, summary, row, errors = episode.reward, episode.summary, episode.row, episode.errors
    if reward is None or summary is None:
        return
    row.reward_at = number(reward, "at")
    row.baseline_exit = summary.get("baseline_exit")
    row.tests_exit = reward.get("tests_exit")
    reported = reward.get("reward")
    if episode.is_real:
        row.steps = summary.get("steps") if isinstance(summary.get("steps"), int) else None
        row.stop_reason = summary.get("stop_reason")
        _agent_reward(row, reward, summary, errors)
    else:
        if reported != 1:
            errors.append(f"reward is {reported!r}, expected 1")
        if row.tests_exit != 0:
            errors.append(f"tests_exit is {row.tests_exit!r} after the action, expected 0")
        row.reward = 1 if reported == 1 else 0
    # A real rollout's task may skip the baseline (`baseline: false`, or tests that only
    # come after the agent): null then. A baseline that ran must have failed.
    skipped = episode.is_real and row.baseline_exit is None
    if not skipped and (row.baseline_exit == 0 or not isinstance(row.baseline_exit, int)):
        errors.append(f"baseline_exit is {row.baseline_exit!r}: the baseline must fail")


def _agent_reward(row: EpisodeRow, reward: Event, summary: Event, errors: list[str]) -> None:
    """A real rollout's reward is any value of its rule: 0 is a sample, not a failure. A
    `file` reward is whatever bounded number the tests wrote (not only 0..1). A row says how
    it was graded and why a reward is below full; a full reward under `all` needs tests that
    exited 0 and no cause against it."""
    reported = reward.get("reward")
    rule = reward.get("reward_rule")
    row.tests_passed, row.tests_total = reward.get("tests_passed"), reward.get("tests_total")
    _grading(row, reward, summary, errors)
    if isinstance(reported, bool) or not isinstance(reported, (int, float)):
        errors.append(f"reward is {reported!r}, expected a number within 0..1")
        return
    step_rewards(row, reward, errors)
    artifacts_refused(row, reward, errors)
    details = reward.get("reward_details")
    if details is not None:
        if isinstance(details, dict) and all(
            isinstance(key, str) and finite(value) for key, value in details.items()
        ):
            row.reward_details = {key: float(value) for key, value in details.items()}
        else:
            errors.append(f"reward_details {details!r} is not an object of finite numbers")
    if rule == "file":
        if not finite(reported) or abs(reported) > MAX_FILE_REWARD:
            errors.append(
                f"reward {reported!r} is not a finite number within +-{MAX_FILE_REWARD:g}"
            )
            return
        row.reward = float(reported)
        return
    if not 0 <= reported <= 1:
        errors.append(f"reward {reported!r} is outside 0..1")
        return
    if rule == "all" and reported not in (0, 1):
        errors.append(f"reward {reported!r} is neither 0 nor 1 (rule all)")
    elif rule == "all" and reported == 1 and (row.tests_exit != 0 or row.grade_cause):
        errors.append(
            f"reward 1 with tests_exit {row.tests_exit!r} and grade_cause "
            f"{row.grade_cause!r} (rule all)"
        )
    elif rule == "all" and reported == 0 and row.tests_exit == 0 and row.graded_by is None:
        errors.append("reward 0 with tests_exit 0 and no grade_cause (rule all)")
    elif rule not in ("all", "fraction"):
        errors.append(f"reward_rule {rule!r} is not all, fraction or file")
    row.reward = float(reported) if rule == "fraction" else int(reported)


def _grading(row: EpisodeRow, reward: Event, summary: Event, errors: list[str]) -> None:
    """graded_by, grade_cause and tests_promised (absent from an older runner's rows). A
    grading sandbox must have held the tests to the baseline the agent's sandbox counted."""
    graded_by, cause = reward.get("graded_by"), reward.get("grade_cause")
    if graded_by is None:
        return
    if graded_by not in set(GradedBy):
        errors.append(f"graded_by {graded_by!r} is not one of {sorted(GradedBy)}")
    else:
        row.graded_by = GradedBy(graded_by)
    if cause is not None and cause not in set(GradeCause):
        errors.append(f"grade_cause {cause!r} is not one of {sorted(GradeCause)}")
    elif cause is not None:
        row.grade_cause = GradeCause(cause)
    elif finite(reward.get("reward")) and reward["reward"] < 1:
        errors.append(f"reward {reward['reward']!r} below full without a grade_cause")
    promised = reward.get("tests_promised")
    if promised is not None and (not isinstance(promised, int) or promised < 0):
        errors.append(f"tests_promised {promised!r} is not an integer >= 0")
        promised = None
    row.tests_promised = promised
    baseline = summary.get("baseline_tests") if summary is not reward else None
    if isinstance(baseline, dict) and baseline.get("collected") != promised:
        errors.append(
            f"the grader held the tests to {promised!r}, the baseline counted "
            f"{baseline.get('collected')!r}"
        )


def agent_command_recorded(episode: Episode) -> None:
    """An agent command's steps are recorded exchanges and it ends with one agent_exit; an
    episode without an agent command has no agent_exit."""
    if episode.is_command and episode.ready is not None:
        for step in episode.steps:
            _exchange_well_formed(step, episode.errors)
        if episode.outcome is not None:
            _agent_exit(episode, episode.ready, episode.outcome)
    elif episode.all(EventKind.AGENT_EXIT):
        episode.errors.append("an agent_exit event in an episode without an agent command")


def _exchange_well_formed(step: Event, errors: list[str]) -> None:
    """The request (its messages apart), the new messages (or the marker of their omission),
    the response (an object, or the marker; null only for an exchange that failed and says why
    in `error`)."""
    step_number = step.get("step")
    if not isinstance(step.get("request"), dict):
        errors.append(f"step event {step_number!r} has no request object")
    new = step.get("new_messages")
    if not isinstance(new, list) and not (isinstance(new, dict) and set(new) == _MARKER_KEYS):
        errors.append(f"step event {step_number!r}: new_messages is neither a list nor omitted")
    response = step.get("response")
    if response is None:
        if not isinstance(step.get("error"), str):
            errors.append(f"step event {step_number!r} has no response and no error")
    elif not isinstance(response, dict):
        errors.append(f"step event {step_number!r}: response {response!r:.80} is not an object")
    status = step.get("status")
    if status is not None and (isinstance(status, bool) or not isinstance(status, int)):
        errors.append(f"step event {step_number!r}: status {status!r} is not an HTTP status")


def _agent_exit(episode: Episode, ready: Event, outcome: Event) -> None:
    """One agent_exit, well formed, after the last step and before the outcome; the outcome's
    agent fields agree with it. Fills the row's agent fields."""
    exits, steps, errors, row = (
        episode.all(EventKind.AGENT_EXIT),
        episode.steps,
        episode.errors,
        episode.row,
    )
    wanted = expected_agent_exits(episode.reward)
    if len(exits) != wanted:
        what = (
            "one agent_exit event" if wanted == 1 else f"{wanted} agent_exit events (a step each)"
        )
        errors.append(f"expected {what}, got {len(exits)}")
        return
    agent_exit = exits[-1]  # with steps, the last step's (each earlier one before it)
    times = [number(e, "at") for e in exits]
    known = [t for t in times if t is not None]
    if len(known) != len(times) or known != sorted(known):
        errors.append("the agent_exit events are out of time order")
    code, timed_out = agent_exit.get("exit_code"), agent_exit.get("timed_out")
    seconds = number(agent_exit, "seconds")
    check_names_the_episode(episode, ready, agent_exit, "agent_exit event")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        errors.append(f"agent_exit exit_code {code!r} is not an integer or null")
    if not isinstance(timed_out, bool) or (code is None) != timed_out:
        errors.append(
            f"agent_exit says timed_out {timed_out!r} with exit_code {code!r}: null is the "
            "exit code of an agent killed at its time limit, and only of one"
        )
    if seconds is None or seconds < 0:
        errors.append(f"agent_exit seconds {agent_exit.get('seconds')!r} is not a duration")
    tail = agent_exit.get("output_tail")
    if not isinstance(tail, str):
        errors.append("agent_exit has no output_tail text")
    at, end = number(agent_exit, "at"), number(outcome, "at")
    last = number(steps[-1], "at") if steps else number(ready, "at")
    if at is None or (last is not None and at < last) or (end is not None and at > end):
        errors.append(f"the agent_exit event is out of time order (at {agent_exit.get('at')!r})")
    row.agent_exit_code, row.agent_seconds = code, seconds
    row.agent_output = tail if isinstance(tail, str) else None
    if episode.summary is not None:  # stale: the agent_exit event is all there is
        _summary_agrees_with_agent_exit(row, episode.summary, code, timed_out, errors)


def _summary_agrees_with_agent_exit(
    row: EpisodeRow, summary: Event, code: Any, timed_out: Any, errors: list[str]
) -> None:
    if summary.get("agent_exit_code") != code:
        errors.append(
            f"{summary['event']} says agent_exit_code {summary.get('agent_exit_code')!r}, "
            f"agent_exit says {code!r}"
        )
    expected = "time_limit" if timed_out else "agent_exit"
    if summary.get("stop_reason") != expected:
        errors.append(
            f"{summary['event']} stop_reason {summary.get('stop_reason')!r}, expected "
            f"{expected!r} (agent_exit timed_out {timed_out!r})"
        )
    output, spent = summary.get("agent_output"), number(summary, "agent_seconds")
    if output is not None and not isinstance(output, str):
        errors.append(f"{summary['event']} agent_output is not text")
    else:
        row.agent_output = output
    if spent is not None:
        row.agent_seconds = spent


def completions_all_recorded(episode: Episode) -> None:
    """A backend that counts the policy completions it answered (the local policy socket):
    more than the runner sent means the agent reached the policy around the recording proxy.
    The sample's trajectory is then not what was sampled: reward 0, said on the row."""
    row = episode.row
    answered = episode.observation.policy_completions
    sent = (row.cost or {}).get("policy_requests")
    if answered is None or row.graded_by is None or (isinstance(sent, int) and answered <= sent):
        return
    row.reward = 0
    row.grade_cause = GradeCause.UNRECORDED_COMPLETIONS

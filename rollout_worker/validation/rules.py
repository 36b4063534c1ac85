"""The rules of an episode's log that do not depend on how it was graded: the sandbox ended
cleanly, the log's events are the ones expected, in order, naming this episode, with
timestamps that agree with each other and with what the backend saw."""

from __future__ import annotations

import itertools
import re
from typing import Any

import orjson

from rollout_wire.states import EventKind
from rollout_worker.validation.episode import (
    GRADE_MODE,
    Episode,
    Event,
    check_names_the_episode,
    number,
)

# Kubernetes timestamps have 1 s resolution and are truncated, so they may read up to one
# second early; never late. Comparisons against them need no slack in that direction.
TIMESTAMP_SLACK = 0.0
# Kubernetes truncates a container's finishedAt to the second: an event may read up to that
# much after it.
ENDED_SLACK = 1.0
_INTEGER = re.compile(r"-?[0-9]+")
# What only the agent's sandbox prints: none may follow its grade_pending.
_AGENT_EVENTS = (EventKind.STEP, EventKind.AGENT_EXIT, EventKind.STALE, EventKind.GRADE_PENDING)


def sandbox_ended_cleanly(episode: Episode) -> None:
    observation, errors = episode.observation, episode.errors
    if observation.phase != "Succeeded":
        reason = f" ({observation.reason})" if observation.reason else ""
        errors.append(f"sandbox phase is {observation.phase}{reason}, expected Succeeded")
    if observation.restart_count != 0:
        errors.append(f"container restarted {observation.restart_count} time(s), expected 0")
    if observation.exit_code != 0:
        errors.append(f"exit code {observation.exit_code}, expected 0")


def log_lines_are_events(episode: Episode) -> None:
    episode.errors.extend(episode.line_problems)


def stale_ends_only_a_real_rollout(episode: Episode) -> None:
    stales, rewards = episode.all(EventKind.STALE), episode.all(EventKind.REWARD)
    if stales and episode.stale is None:
        episode.errors.append(
            f"a stale event only ends a real rollout that has no reward: got {len(stales)} "
            f"stale and {len(rewards)} reward event(s)"
            + ("" if episode.is_real else " in an episode without a policy")
        )


def one_ready_and_one_reward(episode: Episode) -> None:
    readies, rewards = episode.all(EventKind.READY), episode.all(EventKind.REWARD)
    stales = episode.all(EventKind.STALE)
    if len(readies) == episode.readies_wanted and (len(rewards) == 1 or stales):
        return
    episode.errors.append(
        f"expected exactly one ready and one reward event, got {len(readies)} ready and "
        f"{len(rewards)} reward"
        if episode.readies_wanted == 1
        else "expected two ready events (the agent's sandbox, then its grader's) and one "
        f"reward event, got {len(readies)} ready and {len(rewards)} reward"
    )


def grade_pending_ends_only_a_real_rollout(episode: Episode) -> None:
    pendings = episode.all(EventKind.GRADE_PENDING)
    if pendings and episode.grade_pending is None:
        episode.errors.append(
            f"got {len(pendings)} grade_pending event(s): one ends the agent's sandbox of a "
            "real rollout graded fresh"
        )


def fresh_grading_in_order(episode: Episode) -> None:
    """The agent's sandbox ends with grade_pending; the grader's log follows: its ready (mode
    grade, the same task and sample), then the reward. Nothing of the agent's comes later."""
    ready, pending, grader = episode.ready, episode.grade_pending, episode.grader_ready
    errors = episode.errors
    if ready is None or pending is None or grader is None:
        if any(event.get("mode") == GRADE_MODE for event in episode.all(EventKind.READY)):
            errors.append("a grader's ready event without the agent sandbox's grade_pending")
        return
    reward = episode.reward
    position = {id(event): place for place, event in enumerate(episode.events)}
    if grader.get("mode") != GRADE_MODE:
        errors.append(f"the second ready event's mode is {grader.get('mode')!r}, expected grade")
    if not position[id(pending)] < position[id(grader)]:
        errors.append("the grader's ready event comes before the agent's grade_pending")
    if reward is not None and position[id(reward)] < position[id(grader)]:
        errors.append("the reward event comes before the grader's ready event")
    late = [
        event["event"]
        for event in episode.events[position[id(pending)] + 1 :]
        if event["event"] in _AGENT_EVENTS
    ]
    if late:
        errors.append(f"agent events after grade_pending: {sorted(set(late))}")
    for event in (pending, grader, *([reward] if reward is not None else [])):
        for key in ("task_id", "sample", "group_id"):
            if event.get(key) != ready.get(key):
                errors.append(
                    f"{event['event']} event names {key} {event.get(key)!r}, the episode's is "
                    f"{ready.get(key)!r}"
                )


def events_name_the_episode(episode: Episode) -> None:
    singles = (
        episode.ready,
        episode.reward,
        episode.stale,
        episode.grade_pending,
        episode.grader_ready,
    )
    for event in filter(None, singles):
        if event.get("episode_id") != episode.episode_id:
            episode.errors.append(
                f"{event['event']} event names episode {event.get('episode_id')!r}, "
                f"but the sandbox is {episode.episode_id!r}"
            )


def ready_says_what_ran(episode: Episode) -> None:
    """The row's ready time, and in a real rollout its task, sample and group."""
    ready, row = episode.ready, episode.row
    if ready is None:
        return
    row.ready_at = number(ready, "at")
    if episode.is_real:
        row.task_id, row.sample = ready.get("task_id"), ready.get("sample")
        row.group_id = ready.get("group_id")


def no_error_event(episode: Episode) -> None:
    failure = episode.error
    if failure is not None:
        episode.errors.append(
            f"the episode reported an error ({failure.get('kind')}): {failure.get('cause')}"
        )


def steps_name_policy_versions(episode: Episode) -> None:
    """The row's {"first", "last"}: the first and last version the steps name; None when none
    does."""
    named = []
    for step in episode.steps:
        version = step.get("policy_version")
        if version is None:
            continue
        if not isinstance(version, str):
            episode.errors.append(
                f"step event {step.get('step')!r} has policy_version {version!r}, expected a "
                "string or null"
            )
            continue
        named.append(version)
    episode.row.policy_versions = {"first": named[0], "last": named[-1]} if named else None


def _integer(value: Any) -> int | None:
    return int(value) if isinstance(value, str) and _INTEGER.fullmatch(value) else None


def stale_arithmetic_holds(episode: Episode) -> None:
    """The runner's own arithmetic, checked: integer versions, the first one the first step's,
    a lag that is their difference and exceeds the bound. Anything else is a forged outcome."""
    ready, stale, steps, errors = episode.ready, episode.stale, episode.steps, episode.errors
    if stale is None or ready is None:
        return
    episode.row.steps = stale.get("steps") if isinstance(stale.get("steps"), int) else None
    episode.row.stop_reason = EventKind.STALE.value
    first, version = _integer(stale.get("first_version")), _integer(stale.get("version"))
    lag, bound = stale.get("lag"), stale.get("max_policy_lag")
    if number(stale, "at") is None:
        errors.append("the stale event has no numeric 'at' timestamp")
    if "reward" in stale:
        errors.append("the stale event carries a reward: a stale episode has none")
    for key in ("task_id", "group_id"):
        if stale.get(key) != ready.get(key):
            errors.append(
                f"stale event names {key} {stale.get(key)!r}, the episode's is {ready.get(key)!r}"
            )
    if first is None or version is None:
        errors.append(
            f"stale event versions {stale.get('first_version')!r} and {stale.get('version')!r} "
            "must be integer strings"
        )
    elif isinstance(lag, bool) or lag != version - first:
        errors.append(f"stale event lag {lag!r} is not {version} - {first}")
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        errors.append(f"stale event max_policy_lag {bound!r} is not an integer >= 0")
    elif isinstance(lag, int) and not isinstance(lag, bool) and lag <= bound:
        errors.append(f"stale event lag {lag} is within its max_policy_lag {bound}")
    if not steps or steps[0].get("policy_version") != stale.get("first_version"):
        named = steps[0].get("policy_version") if steps else None
        errors.append(
            f"stale event's first_version {stale.get('first_version')!r} is not the first "
            f"step's policy_version ({named!r})"
        )


def steps_in_order(episode: Episode) -> None:
    """Each step names this episode and its task, numbered 1, 2, ... in time order between
    ready and the outcome (reward, or stale); the outcome counts them."""
    ready, errors = episode.ready, episode.errors
    if not episode.is_real or ready is None:
        return
    previous = number(ready, "at")
    for position, step in enumerate(episode.steps, start=1):
        check_names_the_episode(episode, ready, step, f"step event {step.get('step')!r}")
        if step.get("step") != position:
            errors.append(f"step events out of order: step {step.get('step')!r} at {position}")
        at = number(step, "at")
        if at is None or (previous is not None and at < previous):
            errors.append(f"step event {step.get('step')!r} is out of time order (at {at!r})")
        previous = at if at is not None else previous
    outcome = episode.outcome
    if outcome is not None:
        end = number(outcome, "at")
        name = outcome.get("event")
        if previous is not None and end is not None and end < previous:
            errors.append(f"the {name} event is earlier than the last step event")
        if outcome.get("steps") != len(episode.steps):
            errors.append(
                f"{name} counts {outcome.get('steps')!r} steps, the log has {len(episode.steps)}"
            )


def events_have_timestamps(episode: Episode) -> None:
    row = episode.row
    if (episode.ready is not None and row.ready_at is None) or (
        episode.reward is not None and row.reward_at is None
    ):
        episode.errors.append("an event has no numeric 'at' timestamp")


def times_in_order(episode: Episode) -> None:
    """Run created, sandbox created, ready, (grading), reward, stale: in this order; none of
    the sandbox's stamps after the sandbox ended."""
    row, grader = episode.row, episode.grader_ready
    grading = (
        [
            ("grade pending", number(episode.grade_pending, "at")),
            ("grader ready", number(grader, "at")),
        ]
        if grader
        else []
    )
    chain = [
        ("run created", episode.origin),
        ("sandbox created", row.created_at),
        ("ready", row.ready_at),
        *grading,
        ("reward", row.reward_at),
        ("stale", number(episode.stale, "at")),
    ]
    known = [(name, at) for name, at in chain if at is not None]
    for (name_a, at_a), (name_b, at_b) in itertools.pairwise(known):
        if at_a > at_b + TIMESTAMP_SLACK:
            episode.errors.append(
                f"time order violated: {name_a} ({at_a:.3f}) is after {name_b} ({at_b:.3f}); "
                "check clock synchronisation"
            )
    # Events the sandbox stamps cannot come after it ended (as the backend saw it, to the
    # second on Kubernetes): a later stamp is a skewed clock or a forged timestamp.
    last = max((at for _, at in known[1:]), default=None)
    if row.finished_at is not None and last is not None and last > row.finished_at + ENDED_SLACK:
        episode.errors.append(
            f"time order violated: an event is stamped {last:.3f}, after the sandbox ended "
            f"({row.finished_at:.3f}); check clock synchronisation"
        )


def termination_message_agrees(episode: Episode) -> None:
    """The runner's termination message (its summary, read by the backend apart from the
    log) says the same outcome as the log."""
    if not episode.observation.termination_message:
        return
    errors = episode.errors
    try:
        message = orjson.loads(episode.observation.termination_message)
    except orjson.JSONDecodeError:
        errors.append("termination message is not JSON")
        return
    if not isinstance(message, dict):
        errors.append("termination message is not a JSON object")
        return
    outcome = _termination_outcome(episode, message)
    if outcome is None:
        return
    keys, event = outcome
    for key in keys:
        if message.get(key) != event.get(key):
            errors.append(
                f"termination message {key}={message.get(key)!r} disagrees with the log's "
                f"{event.get(key)!r}"
            )


def _termination_outcome(
    episode: Episode, message: dict[str, Any]
) -> tuple[tuple[str, ...], Event] | None:
    """The keys to compare and the log's event they are compared with; None when there is
    nothing to compare (a problem is reported if the two disagree on what happened)."""
    reward, stale, errors = episode.reward, episode.stale, episode.errors
    if message.get(EventKind.GRADE_PENDING):
        # The agent's sandbox of a fresh-graded episode: its grader's log holds the outcome.
        if episode.grade_pending is None:
            errors.append("termination message reports grade_pending, the log has none")
        return None
    if message.get(EventKind.ERROR):
        # The runner's error summary: the log's error event already says what went wrong.
        if reward is not None or stale is not None:
            errors.append("termination message reports an error, but the log has an outcome")
        return None
    if message.get(EventKind.STALE):
        if stale is None:
            errors.append("termination message reports a stale episode, the log does not")
            return None
        return ("first_version", "version", "lag", "episode_id"), stale
    if reward is None:
        errors.append(
            "termination message reports an outcome the log does not contain (log cut or lost)"
        )
        return None
    return ("reward", "baseline_exit", "tests_exit", "episode_id"), reward

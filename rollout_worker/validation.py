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
"""

from __future__ import annotations

import itertools
import math
import re
import time
from typing import Any

import orjson

from rollout_wire.rows import (
    COST_COUNTS,
    COST_PEAK,
    COST_SECONDS,
    COST_SOURCES,
    MAX_FILE_REWARD,
    EpisodeRow,
)
from rollout_wire.states import EpisodeStatus, FailureKind, GradeCause, GradedBy, Progress
from rollout_wire.trajectory import MAX_EVENT_BYTES, STEP_EVENT
from rollout_worker.observation import EpisodeObservation

# Kubernetes timestamps have 1 s resolution and are truncated, so they may read up to one
# second early; never late. Comparisons against them need no slack in that direction.
TIMESTAMP_SLACK = 0.0
# Kubernetes truncates a container's finishedAt to the second: an event may read up to that
# much after it.
ENDED_SLACK = 1.0


# Lines a row lists by name before it only counts the rest.
MAX_LINE_PROBLEMS = 10

# The runner's outcome when its policy moved past the episode's max_policy_lag.
STALE_EVENT = "stale"
AGENT_EXIT_EVENT = "agent_exit"
# The end of a `grade: fresh` episode's first sandbox: its grader's log follows.
GRADE_PENDING_EVENT = "grade_pending"
REAL_MODES = ("agent", "command", "oracle")
COMMAND_MODES = ("command", "oracle")
GRADE_MODE = "grade"
_INTEGER = re.compile(r"-?[0-9]+")


def parse_events(log: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Split an episode log into JSON events, reporting lines that are not events."""
    events: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, line in enumerate(log.splitlines(), start=1):
        if not line.strip():
            continue
        size = len(line.encode("utf-8", "replace"))
        if size > MAX_EVENT_BYTES:
            problems.append(
                f"log line {number} is an oversized event ({size} bytes, the limit is "
                f"{MAX_EVENT_BYTES})"
            )
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            problems.append(f"log line {number} is not a JSON event: {line[:80]!r}")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("event"), str):
            problems.append(f"log line {number} is not an event object: {line[:80]!r}")
            continue
        events.append(value)
    if len(problems) > MAX_LINE_PROBLEMS:
        # A flood of junk is one problem, not a million: the row stays small.
        more = len(problems) - MAX_LINE_PROBLEMS
        problems = [*problems[:MAX_LINE_PROBLEMS], f"... and {more} more lines that are not events"]
    return events, problems


def _number(event: dict[str, Any] | None, key: str) -> float | None:
    value = event.get(key) if event is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_episode(obs: EpisodeObservation, log: str, origin: float) -> EpisodeRow:
    """Validate one finished episode. `origin` is the run's creation time (Job created)."""
    row = EpisodeRow(
        index=obs.index,
        pod=obs.episode_id,
        status=EpisodeStatus.OK,
        exit_code=obs.exit_code,
        restart_count=obs.restart_count,
        phase=obs.phase,
        node=obs.node,
        image_id=obs.image_id,
        created_at=obs.created_at,
        finished_at=obs.finished_at,
        timing=dict(obs.timing),
        collected_at=time.time(),
        retried=[dict(a) for a in obs.retried],
    )
    errors = row.errors
    if obs.phase != "Succeeded":
        reason = f" ({obs.reason})" if obs.reason else ""
        errors.append(f"sandbox phase is {obs.phase}{reason}, expected Succeeded")
    if obs.restart_count != 0:
        errors.append(f"container restarted {obs.restart_count} time(s), expected 0")
    if obs.exit_code != 0:
        errors.append(f"exit code {obs.exit_code}, expected 0")

    events, problems = parse_events(log)
    errors.extend(problems)
    ready = [e for e in events if e.get("event") == Progress.READY]
    reward = [e for e in events if e.get("event") == "reward"]
    stale = [e for e in events if e.get("event") == STALE_EVENT]
    steps = [e for e in events if e.get("event") == STEP_EVENT]
    pending = [e for e in events if e.get("event") == GRADE_PENDING_EVENT]
    exits = [e for e in events if e.get("event") == AGENT_EXIT_EVENT]
    # A fresh-graded episode has a ready event from each of its two sandboxes.
    wanted = 2 if pending else 1
    r = ready[0] if len(ready) == wanted else None
    mode = r.get("mode") if r is not None else None
    agent = mode in REAL_MODES
    command = mode in COMMAND_MODES
    # A stale event stands in for the reward, once, in a real rollout; anything else with one
    # (a reward too, two of them, the demo) is a tampered-with log.
    s = stale[0] if len(stale) == 1 and not reward and not pending and agent else None
    if stale and s is None:
        errors.append(
            f"a stale event only ends a real rollout that has no reward: got {len(stale)} "
            f"stale and {len(reward)} reward event(s)"
            + ("" if agent else " in an episode without a policy")
        )
    if len(ready) != wanted or (len(reward) != 1 and not stale):
        errors.append(
            f"expected exactly one ready and one reward event, got {len(ready)} ready and "
            f"{len(reward)} reward"
            if wanted == 1
            else "expected two ready events (the agent's sandbox, then its grader's) and one "
            f"reward event, got {len(ready)} ready and {len(reward)} reward"
        )
    w = reward[0] if len(reward) == 1 else None
    p = pending[0] if len(pending) == 1 and agent else None
    if pending and p is None:
        errors.append(
            f"got {len(pending)} grade_pending event(s): one ends the agent's sandbox of a "
            "real rollout graded fresh"
        )
    g = ready[1] if p is not None and r is not None else None
    if r is not None and p is not None and g is not None:
        _check_fresh(events, r, p, g, w, errors)
    elif any(e.get("mode") == GRADE_MODE for e in ready):
        errors.append("a grader's ready event without the agent sandbox's grade_pending")
    # Where the baseline, the steps and the agent's fields are: the first sandbox's last word.
    summary = p if p is not None else w
    for event in filter(None, (r, w, s, p, g)):
        if event.get("episode_id") != obs.episode_id:
            errors.append(
                f"{event['event']} event names episode {event.get('episode_id')!r}, "
                f"but the sandbox is {obs.episode_id!r}"
            )
    if r is not None:
        row.ready_at = _number(r, "at")
    if agent and r is not None:
        row.task_id, row.sample, row.group_id = r.get("task_id"), r.get("sample"), r.get("group_id")
    failure = next((e for e in events if e.get("event") == "error"), None)
    if failure is not None:
        errors.append(
            f"the episode reported an error ({failure.get('kind')}): {failure.get('cause')}"
        )
    if w is not None and summary is not None:
        row.reward_at = _number(w, "at")
        row.baseline_exit = summary.get("baseline_exit")
        row.tests_exit = w.get("tests_exit")
        reported = w.get("reward")
        if agent:
            row.steps = summary.get("steps") if isinstance(summary.get("steps"), int) else None
            row.stop_reason = summary.get("stop_reason")
            _check_agent_reward(row, w, summary, errors)
        else:
            if reported != 1:
                errors.append(f"reward is {reported!r}, expected 1")
            if row.tests_exit != 0:
                errors.append(f"tests_exit is {row.tests_exit!r} after the action, expected 0")
            row.reward = 1 if reported == 1 else 0
        # A real rollout's task may skip the baseline (`baseline: false`, or tests that only
        # come after the agent): null then. A baseline that ran must have failed.
        skipped = agent and row.baseline_exit is None
        if not skipped and (row.baseline_exit == 0 or not isinstance(row.baseline_exit, int)):
            errors.append(f"baseline_exit is {row.baseline_exit!r}: the baseline must fail")
    row.policy_versions = _policy_versions(steps, errors)
    if s is not None and r is not None:
        _check_stale(row, r, s, steps, errors)
    outcome = p if p is not None else w if w is not None else s
    if agent and r is not None:
        _check_steps(obs.episode_id, r, outcome, steps, errors)
    if command and r is not None:
        _check_exchanges(steps, errors)
        if outcome is not None:
            _check_agent_exit(row, obs.episode_id, r, exits, steps, outcome, summary, errors)
    elif exits:
        errors.append("an agent_exit event in an episode without an agent command")
    if (r is not None and row.ready_at is None) or (w is not None and row.reward_at is None):
        errors.append("an event has no numeric 'at' timestamp")

    grading = [("grade pending", _number(p, "at")), ("grader ready", _number(g, "at"))] if g else []
    _check_time_order(row, origin, errors, _number(s, "at") if s is not None else None, grading)
    _cross_check_termination(obs, w, errors, s, p)

    if row.ready_at is not None and row.created_at is not None:
        row.pod_to_ready_seconds = row.ready_at - row.created_at
    started = row.timing.get("container_started_at")
    if row.ready_at is not None and "pool_created_at" in row.timing:
        # A warm sandbox started long before its episode: from its claim to ready instead.
        row.timing["handover_seconds"] = row.pod_to_ready_seconds
    elif row.ready_at is not None and started is not None:
        # Runtime and interpreter start-up until the episode could begin work.
        row.timing["runtime_init_seconds"] = row.ready_at - started
    if row.ready_at is not None:
        row.batch_to_ready_seconds = row.ready_at - origin
    if row.reward_at is not None:
        row.batch_to_reward_seconds = row.reward_at - origin
    row.cost = episode_cost(events, row, mode, steps, exits, p, g)
    _check_unrecorded(obs, row)
    if errors:
        row.status = EpisodeStatus.FAILED
        row.reward = 0  # a failed episode never hands the trainer a reward
        row.failure_kind = failure_kind(obs, r, failure)
        row.failure_cause = (
            str(failure.get("cause")) if failure is not None and failure.get("cause") else errors[0]
        )
    elif s is not None:
        # Withdrawn, not failed: no failure kind, and no reward (the tests never ran).
        row.status = EpisodeStatus.STALE
        row.reward = 0
        row.failure_cause = (
            f"stale: first turn at version {s['first_version']}, policy at {s['version']} "
            f"(max lag {s['max_policy_lag']})"
        )
    return row


def _check_unrecorded(obs: EpisodeObservation, row: EpisodeRow) -> None:
    """A backend that counts the policy completions it answered (the local policy socket):
    more than the runner sent means the agent reached the policy around the recording proxy.
    The sample's trajectory is then not what was sampled: reward 0, said on the row."""
    answered = obs.policy_completions
    sent = (row.cost or {}).get("policy_requests")
    if answered is None or row.graded_by is None or (isinstance(sent, int) and answered <= sent):
        return
    row.reward = 0
    row.grade_cause = GradeCause.UNRECORDED_COMPLETIONS


CPU_FIELDS = ("cpu_seconds", "cpu_user_seconds", "cpu_system_seconds")
# The events that end one sandbox's part of an episode; the runner's ledger rides on them.
FINAL_EVENTS = ("reward", GRADE_PENDING_EVENT, STALE_EVENT, "error")


def sanitize_cost(value: Any) -> dict[str, Any] | None:
    """A runner's `cost` object with every field checked: seconds and bytes finite numbers
    >= 0, counts integers >= 0, cpu_source one of COST_SOURCES; anything else is None (the
    ledger informs, it is no rule of the episode: a bad figure is dropped, never an error)."""
    if not isinstance(value, dict):
        return None
    cost: dict[str, Any] = {}
    for name in (*COST_SECONDS, COST_PEAK):
        number: Any = value.get(name)
        cost[name] = float(number) if _finite(number) and number >= 0 else None
    for name in COST_COUNTS:
        count = value.get(name)
        ok = isinstance(count, int) and not isinstance(count, bool) and count >= 0
        cost[name] = count if ok else None
    source = value.get("cpu_source")
    cost["cpu_source"] = source if source in COST_SOURCES else None
    return cost


def _combine_costs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One episode's ledger from its sandboxes' (the agent's, then a grader's): sums, the
    larger peak; a figure one of them lacks is unknown for the whole."""
    cost: dict[str, Any] = {}
    for name in (*COST_SECONDS, *COST_COUNTS, COST_PEAK):
        values = [part[name] for part in parts]
        if any(v is None for v in values):
            cost[name] = None
        else:
            cost[name] = max(values) if name == COST_PEAK else sum(values)
    sources = {part["cpu_source"] for part in parts}
    cost["cpu_source"] = sources.pop() if len(sources) == 1 else None
    return cost


def _duration(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None and end >= start else None


def episode_cost(
    events: list[dict[str, Any]],
    row: EpisodeRow,
    mode: Any,
    steps: list[dict[str, Any]],
    exits: list[dict[str, Any]],
    pending: dict[str, Any] | None,
    grader: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """The row's cost: the ledgers of its final events (one per sandbox), and `wall`, its
    sandbox seconds per phase from the timestamps the row and the events already carry
    (no second clock). None when no final event carries a ledger (an older runner)."""
    parts = [
        part
        for e in events
        if e.get("event") in FINAL_EVENTS and "cost" in e
        if (part := sanitize_cost(e["cost"])) is not None
    ]
    if not parts:
        return None
    cost = _combine_costs(parts)
    if pending is not None and len(parts) < 2:
        # The grader's sandbox never said what it used: the CPU and memory are the agent's
        # sandbox's alone, no figure for the episode. (The policy's all come from the agent's.)
        cost.update(dict.fromkeys((*CPU_FIELDS, COST_PEAK)), cpu_source=None)
    agent: float | None = None
    agent_end: float | None = None
    if mode in COMMAND_MODES and len(exits) == 1:
        agent, agent_end = row.agent_seconds, _number(exits[0], "at")
    elif mode == "agent":
        # The loop's turns: each step times its wait on the policy and its actions.
        spent = [(_number(s, "policy_seconds"), _number(s, "action_seconds")) for s in steps]
        if all(a is not None and b is not None for a, b in spent):
            agent = sum(a + b for a, b in spent if a is not None and b is not None)
        agent_end = _number(steps[-1], "at") if steps else row.ready_at
    tests_start = _number(grader, "at") if grader is not None else agent_end
    start = row.pod_to_ready_seconds
    cost["wall"] = {
        "start": start if start is not None and start >= 0 else None,
        "agent": agent,
        "grader_start": _duration(_number(pending, "at"), _number(grader, "at")),
        "tests": _duration(tests_start, row.reward_at),
    }
    return cost


# The backend's reasons that say the sandbox was ended from outside (deadlines, a stop, a lost
# supervisor, an evicted or unschedulable Pod): never the policy's doing.
INFRASTRUCTURE_REASONS = (
    "DeadlineExceeded",
    "Stopped",
    "SupervisorLost",
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
    sandbox never got ready, or it was ended from outside); else `episode`."""
    if error is not None:
        infrastructure = error.get("kind") == FailureKind.INFRASTRUCTURE
        return FailureKind.INFRASTRUCTURE if infrastructure else FailureKind.EPISODE
    if ready is None or (obs.reason or "") in INFRASTRUCTURE_REASONS:
        return FailureKind.INFRASTRUCTURE
    return FailureKind.EPISODE


def _check_agent_reward(
    row: EpisodeRow, w: dict[str, Any], summary: dict[str, Any], errors: list[str]
) -> None:
    """A real rollout's reward is any value of its rule: 0 is a sample, not a failure. A
    `file` reward is whatever bounded number the tests wrote (not only 0..1). A row says how
    it was graded and why a reward is below full; a full reward under `all` needs tests that
    exited 0 and no cause against it."""
    reported = w.get("reward")
    rule = w.get("reward_rule")
    row.tests_passed, row.tests_total = w.get("tests_passed"), w.get("tests_total")
    _check_grading(row, w, summary, errors)
    if isinstance(reported, bool) or not isinstance(reported, (int, float)):
        errors.append(f"reward is {reported!r}, expected a number within 0..1")
        return
    details = w.get("reward_details")
    if details is not None:
        if isinstance(details, dict) and all(
            isinstance(k, str) and _finite(v) for k, v in details.items()
        ):
            row.reward_details = {k: float(v) for k, v in details.items()}
        else:
            errors.append(f"reward_details {details!r} is not an object of finite numbers")
    if rule == "file":
        if not _finite(reported) or abs(reported) > MAX_FILE_REWARD:
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


def _check_grading(
    row: EpisodeRow, w: dict[str, Any], summary: dict[str, Any], errors: list[str]
) -> None:
    """graded_by, grade_cause and tests_promised (absent from an older runner's rows). A
    grading sandbox must have held the tests to the baseline the agent's sandbox counted."""
    graded_by, cause = w.get("graded_by"), w.get("grade_cause")
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
    elif _finite(w.get("reward")) and w["reward"] < 1:
        errors.append(f"reward {w['reward']!r} below full without a grade_cause")
    promised = w.get("tests_promised")
    if promised is not None and (not isinstance(promised, int) or promised < 0):
        errors.append(f"tests_promised {promised!r} is not an integer >= 0")
        promised = None
    row.tests_promised = promised
    baseline = summary.get("baseline_tests") if summary is not w else None
    if isinstance(baseline, dict) and baseline.get("collected") != promised:
        errors.append(
            f"the grader held the tests to {promised!r}, the baseline counted "
            f"{baseline.get('collected')!r}"
        )


def _policy_versions(steps: list[dict[str, Any]], errors: list[str]) -> dict[str, Any] | None:
    """{"first", "last"}: the first and last version the steps name; None when none does."""
    named = []
    for step in steps:
        version = step.get("policy_version")
        if version is None:
            continue
        if not isinstance(version, str):
            errors.append(
                f"step event {step.get('step')!r} has policy_version {version!r}, expected a "
                "string or null"
            )
            continue
        named.append(version)
    return {"first": named[0], "last": named[-1]} if named else None


def _integer(value: Any) -> int | None:
    return int(value) if isinstance(value, str) and _INTEGER.fullmatch(value) else None


def _check_stale(
    row: EpisodeRow,
    ready: dict[str, Any],
    stale: dict[str, Any],
    steps: list[dict[str, Any]],
    errors: list[str],
) -> None:
    """The runner's own arithmetic, checked: integer versions, the first one the first step's,
    a lag that is their difference and exceeds the bound. Anything else is a forged outcome."""
    row.steps = stale.get("steps") if isinstance(stale.get("steps"), int) else None
    row.stop_reason = STALE_EVENT
    first, version = _integer(stale.get("first_version")), _integer(stale.get("version"))
    lag, bound = stale.get("lag"), stale.get("max_policy_lag")
    if _number(stale, "at") is None:
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


def _check_steps(
    episode_id: str,
    ready: dict[str, Any],
    reward: dict[str, Any] | None,
    steps: list[dict[str, Any]],
    errors: list[str],
) -> None:
    """Each step names this episode and its task, numbered 1, 2, ... in time order between
    ready and the outcome (reward, or stale); the outcome counts them."""
    previous = _number(ready, "at")
    for position, step in enumerate(steps, start=1):
        if step.get("episode_id") != episode_id:
            errors.append(
                f"step event {step.get('step')!r} names episode {step.get('episode_id')!r}, "
                f"but the sandbox is {episode_id!r}"
            )
        for key in ("task_id", "group_id"):
            if step.get(key) != ready.get(key):
                errors.append(
                    f"step event {step.get('step')!r} names {key} {step.get(key)!r}, "
                    f"the episode's is {ready.get(key)!r}"
                )
        if step.get("step") != position:
            errors.append(f"step events out of order: step {step.get('step')!r} at {position}")
        at = _number(step, "at")
        if at is None or (previous is not None and at < previous):
            errors.append(f"step event {step.get('step')!r} is out of time order (at {at!r})")
        previous = at if at is not None else previous
    if reward is not None:
        end = _number(reward, "at")
        name = reward.get("event")
        if previous is not None and end is not None and end < previous:
            errors.append(f"the {name} event is earlier than the last step event")
        if reward.get("steps") != len(steps):
            errors.append(f"{name} counts {reward.get('steps')!r} steps, the log has {len(steps)}")


def _check_fresh(
    events: list[dict[str, Any]],
    ready: dict[str, Any],
    pending: dict[str, Any],
    grader: dict[str, Any],
    reward: dict[str, Any] | None,
    errors: list[str],
) -> None:
    """The agent's sandbox ends with grade_pending; the grader's log follows: its ready (mode
    grade, the same task and sample), then the reward. Nothing of the agent's comes later."""
    position = {id(e): n for n, e in enumerate(events)}
    if grader.get("mode") != GRADE_MODE:
        errors.append(f"the second ready event's mode is {grader.get('mode')!r}, expected grade")
    if not position[id(pending)] < position[id(grader)]:
        errors.append("the grader's ready event comes before the agent's grade_pending")
    if reward is not None and position[id(reward)] < position[id(grader)]:
        errors.append("the reward event comes before the grader's ready event")
    late = [
        e["event"]
        for e in events[position[id(pending)] + 1 :]
        if e["event"] in (STEP_EVENT, AGENT_EXIT_EVENT, STALE_EVENT, GRADE_PENDING_EVENT)
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


_MARKER_KEYS = {"omitted_bytes", "sha256"}


def _check_exchanges(steps: list[dict[str, Any]], errors: list[str]) -> None:
    """An agent command's steps are recorded exchanges: the request (its messages apart), the
    new messages (or the marker of their omission), the response (an object, or the marker;
    null only for an exchange that failed and says why in `error`)."""
    for step in steps:
        number = step.get("step")
        if not isinstance(step.get("request"), dict):
            errors.append(f"step event {number!r} has no request object")
        new = step.get("new_messages")
        if not isinstance(new, list) and not (isinstance(new, dict) and set(new) == _MARKER_KEYS):
            errors.append(f"step event {number!r}: new_messages is neither a list nor omitted")
        response = step.get("response")
        if response is None:
            if not isinstance(step.get("error"), str):
                errors.append(f"step event {number!r} has no response and no error")
        elif not isinstance(response, dict):
            errors.append(f"step event {number!r}: response {response!r:.80} is not an object")
        status = step.get("status")
        if status is not None and (isinstance(status, bool) or not isinstance(status, int)):
            errors.append(f"step event {number!r}: status {status!r} is not an HTTP status")


def _check_agent_exit(
    row: EpisodeRow,
    episode_id: str,
    ready: dict[str, Any],
    exits: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    outcome: dict[str, Any],
    summary: dict[str, Any] | None,
    errors: list[str],
) -> None:
    """One agent_exit, well formed, after the last step and before the outcome; the outcome's
    agent fields agree with it. Fills the row's agent fields."""
    if len(exits) != 1:
        errors.append(f"expected one agent_exit event, got {len(exits)}")
        return
    x = exits[0]
    code, timed_out, seconds = x.get("exit_code"), x.get("timed_out"), _number(x, "seconds")
    if x.get("episode_id") != episode_id:
        errors.append(
            f"agent_exit event names episode {x.get('episode_id')!r}, but the sandbox is "
            f"{episode_id!r}"
        )
    for key in ("task_id", "group_id"):
        if x.get(key) != ready.get(key):
            errors.append(
                f"agent_exit event names {key} {x.get(key)!r}, the episode's is {ready.get(key)!r}"
            )
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        errors.append(f"agent_exit exit_code {code!r} is not an integer or null")
    if not isinstance(timed_out, bool) or (code is None) != timed_out:
        errors.append(
            f"agent_exit says timed_out {timed_out!r} with exit_code {code!r}: null is the "
            "exit code of an agent killed at its time limit, and only of one"
        )
    if seconds is None or seconds < 0:
        errors.append(f"agent_exit seconds {x.get('seconds')!r} is not a duration")
    if not isinstance(x.get("output_tail"), str):
        errors.append("agent_exit has no output_tail text")
    at, end = _number(x, "at"), _number(outcome, "at")
    last = _number(steps[-1], "at") if steps else _number(ready, "at")
    if at is None or (last is not None and at < last) or (end is not None and at > end):
        errors.append(f"the agent_exit event is out of time order (at {x.get('at')!r})")
    row.agent_exit_code, row.agent_seconds = code, seconds
    row.agent_output = x.get("output_tail") if isinstance(x.get("output_tail"), str) else None
    if summary is None:
        return  # stale: the agent_exit event is all there is
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
    output, spent = summary.get("agent_output"), _number(summary, "agent_seconds")
    if output is not None and not isinstance(output, str):
        errors.append(f"{summary['event']} agent_output is not text")
    else:
        row.agent_output = output
    if spent is not None:
        row.agent_seconds = spent


def _check_time_order(
    row: EpisodeRow,
    origin: float,
    errors: list[str],
    stale_at: float | None = None,
    grading: list[tuple[str, float | None]] | None = None,
) -> None:
    chain = [
        ("run created", origin),
        ("sandbox created", row.created_at),
        ("ready", row.ready_at),
        *(grading or []),
        ("reward", row.reward_at),
        ("stale", stale_at),
    ]
    known = [(name, at) for name, at in chain if at is not None]
    for (name_a, a), (name_b, b) in itertools.pairwise(known):
        if a > b + TIMESTAMP_SLACK:
            errors.append(
                f"time order violated: {name_a} ({a:.3f}) is after {name_b} ({b:.3f}); "
                "check clock synchronisation"
            )
    # Events the sandbox stamps cannot come after it ended (as the backend saw it, to the
    # second on Kubernetes): a later stamp is a skewed clock or a forged timestamp.
    last = max((at for _, at in known[1:]), default=None)
    if row.finished_at is not None and last is not None and last > row.finished_at + ENDED_SLACK:
        errors.append(
            f"time order violated: an event is stamped {last:.3f}, after the sandbox ended "
            f"({row.finished_at:.3f}); check clock synchronisation"
        )


def _cross_check_termination(
    obs: EpisodeObservation,
    reward: dict[str, Any] | None,
    errors: list[str],
    stale: dict[str, Any] | None = None,
    pending: dict[str, Any] | None = None,
) -> None:
    if not obs.termination_message:
        return
    try:
        message = orjson.loads(obs.termination_message)
    except orjson.JSONDecodeError:
        errors.append("termination message is not JSON")
        return
    if not isinstance(message, dict):
        errors.append("termination message is not a JSON object")
        return
    if message.get(GRADE_PENDING_EVENT):
        # The agent's sandbox of a fresh-graded episode: its grader's log holds the outcome.
        if pending is None:
            errors.append("termination message reports grade_pending, the log has none")
        return
    if message.get("error"):
        # The runner's error summary: the log's error event already says what went wrong.
        if reward is not None or stale is not None:
            errors.append("termination message reports an error, but the log has an outcome")
        return
    if message.get("stale"):
        if stale is None:
            errors.append("termination message reports a stale episode, the log does not")
            return
        keys: tuple[str, ...] = ("first_version", "version", "lag", "episode_id")
        outcome = stale
    elif reward is None:
        errors.append(
            "termination message reports an outcome the log does not contain (log cut or lost)"
        )
        return
    else:
        keys, outcome = ("reward", "baseline_exit", "tests_exit", "episode_id"), reward
    for key in keys:
        if message.get(key) != outcome.get(key):
            errors.append(
                f"termination message {key}={message.get(key)!r} disagrees with the log's "
                f"{outcome.get(key)!r}"
            )


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
        row.retried = [dict(a) for a in obs.retried]
    return row

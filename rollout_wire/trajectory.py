"""An episode's trajectory: what the agent runner printed, read back as steps.

The runner prints one JSON event per line (`rollout_wire.states.EventKind`): `ready`, one
`step` per policy turn (the turn's actions with their observations, timings, the server's
verbatim response), then `reward` (or an `error`). The collectors validate the log
(`rollout_worker.validation`); this module is the one definition of how a log is split into
events and how a validated log reads as a trajectory, used by the workers' store and the
trainer's client alike.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_wire.states import OUTCOME_EVENTS, EventKind
from rollout_wire.tokens import token_view

# A single event line above this is refused by the collectors (the episode is failed): the
# runner cuts observations to 4 KiB and leaves out responses above 192 KiB, so only a broken or
# tampered-with runner writes one.
MAX_EVENT_BYTES = 256 * 1024
# Lines a row lists by name before it only counts the rest.
MAX_LINE_PROBLEMS = 10


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


def events_of(log: str) -> list[dict[str, Any]]:
    """The log's JSON event objects, skipping anything else (validation reports those)."""
    return parse_events(log)[0]


def trajectory_from_log(log: str) -> dict[str, Any]:
    """{episode_id, task_id, sample, group_id, steps: [...], outcome: the reward, error or
    stale event, tokens: the token view trainers consume (rollout_wire.tokens)}, made once
    when the episode is collected."""
    events = events_of(log)
    ready = next((e for e in events if e["event"] == EventKind.READY), {})
    outcome = next((e for e in events if e["event"] in OUTCOME_EVENTS), None)
    steps = [e for e in events if e["event"] == EventKind.STEP]
    return {
        "episode_id": ready.get("episode_id"),
        "task_id": ready.get("task_id"),
        "sample": ready.get("sample"),
        "group_id": ready.get("group_id"),
        "policy_base_url": ready.get("policy_base_url"),
        "steps": steps,
        "outcome": outcome,
        "tokens": token_view(steps),
    }

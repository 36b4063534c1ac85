"""An episode's trajectory: what the agent runner printed, read back as steps.

The runner prints one JSON event per line: `ready`, one `step` per policy turn (the turn's
actions with their observations, timings, the server's verbatim response), then `reward` (or
an `error`). The collectors validate the log (`rollout_worker.validation`); this module is the
one definition of how a validated log reads as a trajectory, used by the workers' store and
the trainer's client alike.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_wire.tokens import token_view

# A single event line above this is refused by the collectors (the episode is failed): the
# runner cuts observations to 4 KiB and leaves out responses above 192 KiB, so only a broken or
# tampered-with runner writes one.
MAX_EVENT_BYTES = 256 * 1024
STEP_EVENT = "step"


def events_of(log: str) -> list[dict[str, Any]]:
    """The log's JSON event objects, skipping anything else (validation reports those)."""
    found = []
    for line in log.splitlines():
        if not line.strip() or len(line) > MAX_EVENT_BYTES:
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("event"), str):
            found.append(value)
    return found


def trajectory_from_log(log: str) -> dict[str, Any]:
    """{episode_id, task_id, sample, group_id, steps: [...], outcome: the reward, error or
    stale event, tokens: the token view trainers consume (rollout_wire.tokens)}, made once
    when the episode is collected."""
    events = events_of(log)
    ready = next((e for e in events if e["event"] == "ready"), {})
    outcome = next((e for e in events if e["event"] in ("reward", "error", "stale")), None)
    steps = [e for e in events if e["event"] == STEP_EVENT]
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

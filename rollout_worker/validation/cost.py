"""What an episode cost and where its time went: the runner's ledgers (one per sandbox, on its
final event) checked and combined, and the row's phase durations from timestamps it already
carries. These inform; they are no rule of the episode (a bad figure is dropped, never an
error)."""

from __future__ import annotations

from typing import Any

from rollout_wire.rows import COST_COUNTS, COST_PEAK, COST_SECONDS, COST_SOURCES
from rollout_wire.states import FINAL_EVENTS, EventKind
from rollout_worker.validation.episode import COMMAND_MODES, Episode, finite, number

CPU_FIELDS = ("cpu_seconds", "cpu_user_seconds", "cpu_system_seconds")


def timings_from_stamps(episode: Episode) -> None:
    """The row's durations from the sandbox's creation and the run's to ready and reward."""
    row, origin = episode.row, episode.origin
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


def cost_from_ledgers(episode: Episode) -> None:
    episode.row.cost = episode_cost(episode)


def sanitize_cost(value: Any) -> dict[str, Any] | None:
    """A runner's `cost` object with every field checked: seconds and bytes finite numbers
    >= 0, counts integers >= 0, cpu_source one of COST_SOURCES; anything else is None (the
    ledger informs, it is no rule of the episode: a bad figure is dropped, never an error)."""
    if not isinstance(value, dict):
        return None
    cost: dict[str, Any] = {}
    for name in (*COST_SECONDS, COST_PEAK):
        figure: Any = value.get(name)
        cost[name] = float(figure) if finite(figure) and figure >= 0 else None
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
        if any(value is None for value in values):
            cost[name] = None
        else:
            cost[name] = max(values) if name == COST_PEAK else sum(values)
    sources = {part["cpu_source"] for part in parts}
    cost["cpu_source"] = sources.pop() if len(sources) == 1 else None
    return cost


def _duration(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None and end >= start else None


def episode_cost(episode: Episode) -> dict[str, Any] | None:
    """The row's cost: the ledgers of its final events (one per sandbox), and `wall`, its
    sandbox seconds per phase from the timestamps the row and the events already carry
    (no second clock). None when no final event carries a ledger (an older runner)."""
    parts = [
        part
        for event in episode.events
        if event.get("event") in FINAL_EVENTS and "cost" in event
        if (part := sanitize_cost(event["cost"])) is not None
    ]
    if not parts:
        return None
    cost = _combine_costs(parts)
    pending, grader, row = episode.grade_pending, episode.grader_ready, episode.row
    if pending is not None and len(parts) < 2:
        # The grader's sandbox never said what it used: the CPU and memory are the agent's
        # sandbox's alone, no figure for the episode. (The policy's all come from the agent's.)
        cost.update(dict.fromkeys((*CPU_FIELDS, COST_PEAK)), cpu_source=None)
    agent, agent_end = _agent_seconds(episode)
    tests_start = number(grader, "at") if grader is not None else agent_end
    start = row.pod_to_ready_seconds
    cost["wall"] = {
        "start": start if start is not None and start >= 0 else None,
        "agent": agent,
        "grader_start": _duration(number(pending, "at"), number(grader, "at")),
        "tests": _duration(tests_start, row.reward_at),
    }
    return cost


def _agent_seconds(episode: Episode) -> tuple[float | None, float | None]:
    """The agent's seconds, and when it ended (None: unknown)."""
    exits, steps = episode.all(EventKind.AGENT_EXIT), episode.steps
    if episode.mode in COMMAND_MODES and len(exits) == 1:
        return episode.row.agent_seconds, number(exits[0], "at")
    if episode.mode == "agent":
        # The loop's turns: each step times its wait on the policy and its actions.
        spent = [(number(step, "policy_seconds"), number(step, "action_seconds")) for step in steps]
        seconds = [
            policy + action for policy, action in spent if policy is not None and action is not None
        ]
        agent = sum(seconds) if len(seconds) == len(spent) else None
        return agent, number(steps[-1], "at") if steps else episode.row.ready_at
    return None, None

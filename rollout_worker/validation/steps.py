"""A task with steps: the reward event's `step_rewards` (each run step's name, reward, grade
cause and tests' exit status) checked and kept on the row, and the episode's reward held to
the combination its strategy names (Harbor's multi_step_reward_strategy)."""

from __future__ import annotations

import math
from typing import Any

from rollout_wire.rows import MAX_FILE_REWARD, EpisodeRow
from rollout_wire.states import GradeCause
from rollout_wire.task_steps import (
    MAX_TASK_STEPS,
    STEP_REWARD_STRATEGIES,
    combine_step_rewards,
)

_STEP_KEYS = {"name", "reward", "grade_cause", "tests_exit"}


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _step_problem(step: Any) -> str | None:
    if not isinstance(step, dict) or set(step) != _STEP_KEYS:
        return f"is not an object of {sorted(_STEP_KEYS)}"
    if not isinstance(step["name"], str) or not step["name"]:
        return "has no name"
    if not _finite(step["reward"]) or abs(step["reward"]) > MAX_FILE_REWARD:
        return f"reward {step['reward']!r} is not a finite number within +-{MAX_FILE_REWARD:g}"
    cause = step["grade_cause"]
    if cause is not None and cause not in set(GradeCause):
        return f"grade_cause {cause!r} is not one of {sorted(GradeCause)}"
    code = step["tests_exit"]
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        return f"tests_exit {code!r} is not an integer"
    return None


def step_rewards(row: EpisodeRow, reward: dict[str, Any], errors: list[str]) -> None:
    """The row's step_rewards (None for a task without steps), and its reward their
    combination."""
    steps = reward.get("step_rewards")
    if steps is None:
        return
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_TASK_STEPS:
        errors.append(f"step_rewards is not a list of 1..{MAX_TASK_STEPS} steps")
        return
    for position, step in enumerate(steps):
        problem = _step_problem(step)
        if problem is not None:
            errors.append(f"step_rewards[{position}] {problem}")
            return
    strategy = reward.get("step_reward_strategy")
    if strategy not in STEP_REWARD_STRATEGIES:
        errors.append(f"step_reward_strategy {strategy!r} is not one of {STEP_REWARD_STRATEGIES}")
        return
    expected = combine_step_rewards(strategy, [s["reward"] for s in steps])
    reported: Any = reward.get("reward")
    if not _finite(reported) or not math.isclose(reported, expected, abs_tol=1e-9):
        errors.append(f"reward {reported!r} is not the {strategy} of the steps' ({expected!r})")
        return
    row.step_rewards = [dict(s) for s in steps]


def expected_agent_exits(reward: dict[str, Any] | None) -> int:
    """An agent command (or the oracle) exits once per step that ran; once without steps."""
    steps = (reward or {}).get("step_rewards")
    return len(steps) if isinstance(steps, list) and steps else 1

"""A task with steps (Harbor's [[steps]]): each step's agent, then its tests, in this one
sandbox, in order; a step below its min_reward ends the episode. Each step is graded as a
task is (the grader's rules, its tests placed only after its agent is gone), and its tests
are gone again before the next step's agent starts."""

from __future__ import annotations

import contextlib
import os
import time
import typing

from .grader import TESTS_DIR
from .judging import CAUSE_REWARD_FILE
from .workspace import empty_folder


def combine_rewards(strategy: str, rewards: list) -> float:
    """Harbor's multi_step_reward_strategy over the steps that ran: `final` the last one's,
    `mean` (its default) their mean (a step gated off has no result and is left out)."""
    if not rewards:
        return 0.0
    if strategy == "final":
        return float(rewards[-1])
    return float(sum(rewards) / len(rewards))


def step_limit(step: dict, name: str, budget: dict) -> float:
    """A step's own limit, within what is left of the task's: the task's time_limit_seconds
    and test_timeout_seconds are the whole episode's budget for its steps (what the episode
    timeout was checked against), so no step runs past it. At least a second."""
    own = float(step.get(name, budget[name]))
    return max(1.0, min(own, budget[name]))


def spend(budget: dict, name: str, since: float) -> None:
    budget[name] = budget[name] - (time.monotonic() - since)


def run_step(runner: typing.Any, task: dict, step: dict, done: int, budget: dict) -> tuple:
    """One step: its agent on its statement, then its tests. (agent fields, grade fields)."""
    runner.task = dict(
        task, statement=step["statement"], tests=step["tests"], solution=step.get("solution") or {}
    )
    runner.time_limit = step_limit(step, "time_limit_seconds", budget)
    runner.test_timeout = step_limit(step, "test_timeout_seconds", budget)
    runner.step_offset = done
    began = time.monotonic()
    if runner.mode == "agent":
        count, stop_reason = runner.loop()
        acted: dict = {"steps": done + count, "stop_reason": stop_reason}
    else:
        acted = runner.act()
        acted["steps"] = done + acted["steps"]
    spend(budget, "time_limit_seconds", began)
    began = time.monotonic()
    try:
        graded = runner.grade()
    finally:
        spend(budget, "test_timeout_seconds", began)
        # This step's tests gone before the next step's agent: /tests holds nothing between.
        # (grade emptied the same folders before placing the tests: no other is touched.)
        placed_in = {runner.places["ROLLOUT_TESTS_DIR"]}
        if runner.tests_dir != TESTS_DIR:  # a temporary folder fresh_dir fell back to
            placed_in.add(runner.tests_dir)
        for placed in placed_in:
            if os.path.isdir(placed):
                with contextlib.suppress(OSError):
                    empty_folder(placed)
        runner.tests_dir = TESTS_DIR
    return acted, graded


def run_steps(runner: typing.Any) -> dict:
    """The reward event's fields of a task with steps: the last run step's grading, the
    combined reward, and each run step's {name, reward, grade_cause, tests_exit}."""
    task = runner.task
    strategy = task.get("step_reward_strategy", "mean")
    results: list = []
    acted: dict = {"steps": 0}
    graded: dict = {}
    budget = {
        "time_limit_seconds": float(task.get("time_limit_seconds", 60)),
        "test_timeout_seconds": float(task.get("test_timeout_seconds", 60)),
    }
    try:
        for step in task["steps"]:
            acted, graded = run_step(runner, task, step, acted["steps"], budget)
            reward = graded.get("reward", 0)
            results.append(
                {
                    "name": step["name"],
                    "reward": reward,
                    "grade_cause": graded.get("grade_cause"),
                    "tests_exit": graded.get("tests_exit"),
                }
            )
            bound = step.get("min_reward")
            if bound is not None and reward < bound:
                break  # Harbor's early stop: the later steps do not run
    finally:
        runner.task = task
    final = combine_rewards(strategy, [r["reward"] for r in results])
    causes = [r["grade_cause"] for r in results if r["grade_cause"]]
    cause = None if final >= 1 else (causes[0] if causes else CAUSE_REWARD_FILE)
    return {
        **graded,
        **acted,
        "reward": final,
        "grade_cause": cause,
        "step_rewards": results,
        "step_reward_strategy": strategy,
    }

"""A task with steps (Harbor's [[steps]]): each step's agent, then its tests, in this one
sandbox, in order; a step below its min_reward ends the episode. Each step is graded as a
task is (the grader's rules, its tests placed only after its agent is gone), and its tests
are gone again before the next step's agent starts.

A backend may instead run each step's agent and each step's tests in containers of their own,
in order, over one workspace, /tmp and /logs (Kubernetes: the episode Pod's init containers,
agent 1, tests 1, agent 2, ..., the Pod's container grading the last step): pod_part below."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import typing

from .cost import LEDGER
from .errors import InfrastructureError
from .events import emit, record_outcome
from .grader import TESTS_DIR
from .handoff import HANDOFF_ENV, replace_json
from .judging import CAUSE_REWARD_FILE
from .processes import kill_leftovers
from .task import STEP_ENV
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


def act_step(runner: typing.Any, task: dict, step: dict, done: int, budget: dict) -> dict:
    """A step's agent on its statement, within what is left of the budget: its agent fields."""
    runner.task = dict(
        task, statement=step["statement"], tests=step.get("tests") or {},
        solution=step.get("solution") or {},
    )  # fmt: skip
    runner.time_limit = step_limit(step, "time_limit_seconds", budget)
    runner.step_offset = done
    began = time.monotonic()
    if runner.mode == "agent":
        count, stop_reason = runner.loop()
        acted: dict = {"steps": done + count, "stop_reason": stop_reason}
    else:
        acted = runner.act()
        acted["steps"] = done + acted["steps"]
    spend(budget, "time_limit_seconds", began)
    return acted


def grade_step(runner: typing.Any, task: dict, step: dict, budget: dict) -> dict:
    """A step's tests, placed only now, then gone again: its grade fields."""
    runner.task = dict(task, statement=step.get("statement", ""), tests=step["tests"])
    runner.test_timeout = step_limit(step, "test_timeout_seconds", budget)
    began = time.monotonic()
    try:
        return runner.grade()
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
        runner.task = task


def step_result(step: dict, graded: dict) -> dict:
    """A run step's entry in step_rewards."""
    return {
        "name": step["name"],
        "reward": graded.get("reward", 0),
        "grade_cause": graded.get("grade_cause"),
        "tests_exit": graded.get("tests_exit"),
    }


def gated(step: dict, result: dict) -> bool:
    """Harbor's early stop: a step below its min_reward ends the episode."""
    bound = step.get("min_reward")
    return bound is not None and result["reward"] < bound


def first_budget(task: dict) -> dict:
    """The steps' shared budget (the task's limits, what the episode timeout was checked
    against)."""
    return {
        "time_limit_seconds": float(task.get("time_limit_seconds", 60)),
        "test_timeout_seconds": float(task.get("test_timeout_seconds", 60)),
    }


def episode_fields(task: dict, results: list, graded: dict, acted: dict) -> dict:
    """The reward event's fields of a task with steps: the last run step's grading and
    agent, the combined reward, and each run step's {name, reward, grade_cause, tests_exit}."""
    strategy = task.get("step_reward_strategy", "mean")
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
        "baseline_exit": None,
        "baseline_tests": None,
    }


def run_steps(runner: typing.Any) -> dict:
    """The reward event's fields of a task with steps run in this one sandbox (each step's
    agent, then its tests) until the last step or one below its min_reward."""
    task = runner.task
    results: list = []
    acted: dict = {"steps": 0}
    graded: dict = {}
    budget = first_budget(task)
    try:
        for step in task["steps"]:
            acted = act_step(runner, task, step, acted["steps"], budget)
            graded = grade_step(runner, task, step, budget)
            results.append(step_result(step, graded))
            if gated(step, results[-1]):
                break  # Harbor's early stop: the later steps do not run
    finally:
        runner.task = task
    return episode_fields(task, results, graded, acted)


# -- steps apart: each step's agent and tests in containers of their own ---------------------
# A task with steps where each step's agent and each step's tests run in containers of their
# own, in order, over one workspace, /tmp and /logs (Kubernetes: the episode Pod's init
# containers, agent 1, tests 1, agent 2, ..., the Pod's container grading the last step). This
# container's part is ROLLOUT_STEP's agent or tests; the episode's meaning is multistep.py's.
#
# What passes between them, and who can touch it:
# - an agent container leaves its fields (the step it ran, the policy steps so far, what is
#   left of the agents' budget) in the hand-over folder, written after every agent process is
#   gone; the next agent's runner and the step's grader read it before any other process of
#   theirs exists (graders mount it read-only);
# - a grader takes the steps' results so far (STATE_ENV: a folder no agent container mounts)
#   into memory and removes them before the step's tests run (the code under test runs in the
#   grader's container), and writes them back, its own added, after every process of the tests
#   is gone; the last grader reports the episode's reward event;
# - the gate (GATE_ENV: written by graders, read-only to agents) says only that a step fell below
#   its min_reward: the later containers then do nothing, as Harbor runs no later step.
# Each container's step (its statement, and solution for the oracle; or its tests) is a file
# only that container mounts (STEP_FILE_ENV).


STEP_LAST_ENV = "ROLLOUT_STEP_LAST"  # "1" in the container that reports the episode
STEP_FILE_ENV = "ROLLOUT_STEP_FILE"  # {task id: this container's step}
STATE_ENV = "ROLLOUT_STEP_STATE_DIR"
GATE_ENV = "ROLLOUT_STEP_GATE_DIR"
AGENT_STATE = "step-agent.json"
GRADE_STATE = "steps.json"
GATE_CLOSED = "closed"
MAX_STATE_BYTES = 1024 * 1024


def pod_step() -> int | None:
    """This container's step when the backend runs steps apart, else None."""
    value = os.environ.get(STEP_ENV)
    return int(value) if value else None


def pod_part(runner: typing.Any, phase: str) -> int | None:
    """This container's exit status when its part is decided here; None: the runner goes on
    as usual (step 1's agent container sets the task up first; a task without steps is run
    by step 1's agent container and graded by the last)."""
    step = pod_step()
    if step is None:
        return None
    steps = runner.task.get("steps")
    last = os.environ.get(STEP_LAST_ENV) == "1"
    if not steps:
        return None if (phase == "agent" and step == 1) or (phase == "grade" and last) else 0
    if phase == "grade":
        return grade_part(runner, step, last)
    if step > len(steps) or gate_closed():
        return 0  # no such step for this task, or an earlier one ended the episode
    if step == 1:
        return None  # Runner.run: set up, the healthcheck, ready, then agent_part
    runner.need_task_env()
    return agent_part(runner, step)


def gate_closed() -> bool:
    return os.path.lexists(os.path.join(os.environ.get(GATE_ENV, "/nonexistent"), GATE_CLOSED))


def _read_json(path: str, what: str, links: bool = False) -> typing.Any:
    """`path`'s JSON, never through a link unless `links` (a ConfigMap's file is one)."""
    try:
        fd = os.open(path, os.O_RDONLY | (0 if links else os.O_NOFOLLOW))
        with os.fdopen(fd, "rb") as handle:
            return json.loads(handle.read(MAX_STATE_BYTES))
    except (OSError, ValueError) as exc:
        raise InfrastructureError(f"{what} cannot be read: {exc}") from None


def _write_json(folder: str, name: str, value: typing.Any) -> None:
    """`value` at folder/name, over whatever was left at that name (a link, a folder)."""
    try:
        replace_json(folder, name, value)
    except OSError as exc:
        raise InfrastructureError(f"{name} cannot be written for the next step: {exc}") from None


def own_step(runner: typing.Any) -> dict:
    """This container's step of the episode's task (its file is this container's alone)."""
    # A file of the Pod's ConfigMap, mounted read-only in this container alone.
    steps = _read_json(os.environ.get(STEP_FILE_ENV, ""), "this container's step", links=True)
    step = steps.get(runner.task["id"]) if isinstance(steps, dict) else None
    if not isinstance(step, dict):
        raise InfrastructureError("this container's step was not handed over")
    return step


def agent_part(runner: typing.Any, number: int) -> int:
    """Step `number`'s agent, from where the previous step's left the budget; its fields in
    the hand-over folder once every process of the agent is gone."""
    task, step = runner.task, own_step(runner)
    handoff = os.environ.get(HANDOFF_ENV, "")
    if number == 1:
        done, budget = 0, first_budget(task)
    else:
        before = _read_json(os.path.join(handoff, AGENT_STATE), "the previous step's agent")
        if not isinstance(before, dict) or before.get("step") != number - 1:
            raise InfrastructureError(f"step {number - 1}'s agent left no hand-over")
        done, budget = int(before["acted"]["steps"]), dict(before["budget"])
    if runner.mode != "oracle":
        runner.need_policy()
    tests = runner.places["ROLLOUT_TESTS_DIR"]
    if os.path.isdir(tests):  # as in one sandbox: no agent finds an earlier agent's files there
        with contextlib.suppress(OSError):
            empty_folder(tests)
    acted = act_step(runner, task, step, done, budget)
    kill_leftovers()
    moved = {"step": number, "acted": acted, "budget": budget, "cost": LEDGER.measure()}
    _write_json(handoff, AGENT_STATE, moved)
    return 0


def _take_state(folder: str, number: int) -> dict:
    """The results so far, in memory, the file gone (the code under test runs next)."""
    if number == 1:
        state: dict = {"results": [], "closed": False, "budget": None}
    else:
        state = _read_json(os.path.join(folder, GRADE_STATE), "the earlier steps' results")
        if not isinstance(state, dict) or not isinstance(state.get("results"), list):
            raise InfrastructureError("the earlier steps' results are not a list")
    target = os.path.join(folder, GRADE_STATE)
    with contextlib.suppress(FileNotFoundError):
        try:
            os.unlink(target)
        except IsADirectoryError:
            shutil.rmtree(target)
    return state


def grade_part(runner: typing.Any, number: int, last: bool) -> int:
    """Step `number`'s tests when its agent ran (the gate open); the last container then
    reports the episode, any other leaves the results for the next."""
    runner.need_task_env()
    task, folder = runner.task, os.environ.get(STATE_ENV, "")
    state = _take_state(folder, number)
    if number <= len(task["steps"]) and not state["closed"]:
        step = own_step(runner)
        path = os.path.join(os.environ.get(HANDOFF_ENV, ""), AGENT_STATE)
        agent = _read_json(path, "the step's agent hand-over")
        if not isinstance(agent, dict) or agent.get("step") != number:
            raise InfrastructureError(f"step {number}'s agent left no hand-over")
        budget = state["budget"] or first_budget(task)
        state["graded"] = grade_step(runner, task, step, budget)
        state["budget"], state["acted"] = budget, agent["acted"]
        state["results"].append(step_result(step, state["graded"]))
        state["closed"] = gated(step, state["results"][-1])
        state["costs"] = [*state.get("costs", []), agent.get("cost")]
    if last:
        graded, acted = state.get("graded") or {}, state.get("acted") or {}
        fields = episode_fields(task, state["results"], graded, acted)
        own = LEDGER.measure
        # The episode's ledger: this container's reading with the earlier containers' added.
        LEDGER.measure = lambda: add_costs(own(), state.get("costs", []))  # type: ignore[method-assign]
        record_outcome(emit("reward", **fields, grade="same", **runner.identity))
        return 0
    kill_leftovers()
    state["costs"] = [*state.get("costs", []), LEDGER.measure()]
    _write_json(folder, GRADE_STATE, state)
    gate = os.path.join(os.environ.get(GATE_ENV, ""), GATE_CLOSED)
    try:
        if state["closed"]:
            _write_json(os.path.dirname(gate), GATE_CLOSED, True)
        elif os.path.lexists(gate):
            if os.path.isdir(gate) and not os.path.islink(gate):
                shutil.rmtree(gate)
            else:
                os.unlink(gate)
    except OSError as exc:
        raise InfrastructureError(f"the steps' gate cannot be set: {exc}") from None
    return 0


COST_SUMS = (
    "cpu_seconds",
    "cpu_user_seconds",
    "cpu_system_seconds",
    "policy_seconds",
    "policy_retry_seconds",
    "policy_turns",
    "prompt_tokens",
    "completion_tokens",
    "policy_requests",
)


def _figure(value: object) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def add_costs(cost: dict, earlier: list) -> dict:
    """`cost` (one container's ledger) with the earlier containers' added: each container
    reads its own cgroup and its own policy figures. Sums, the larger peak; a figure one of
    them lacks is unknown for the whole (as validation combines an agent's and a grader's)."""
    for part in earlier:
        part = part if isinstance(part, dict) else {}
        for name in (*COST_SUMS, "peak_memory_bytes"):
            mine, theirs = _figure(cost.get(name)), _figure(part.get(name))
            if mine is None or theirs is None:
                cost[name] = None
            else:
                cost[name] = max(mine, theirs) if name == "peak_memory_bytes" else mine + theirs
        if part.get("cpu_source") != cost.get("cpu_source"):
            cost["cpu_source"] = None
    return cost

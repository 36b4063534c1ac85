"""Tasks with steps (Harbor's [[steps]]) in a Pod: agent, tests, agent, tests ... as its
containers, in order, over one workspace. Pure, as pod_spec.py (which calls `chain_steps`
once the Pod grades apart).

For n steps (the most any task of the Job has) the Pod runs, in order: step 1's agent (the
init container AGENT_CONTAINER, which sets the task up), step 1's grader (`grade-1`), step 2's
agent (`agent-2`), ..., step n's agent, and the Pod's container, which grades step n and
reports the episode (runner/multistep.py pod_part). All share the workspace, /tmp, /logs and
/solution, as one sandbox does across its steps. What each may see:
- an agent container mounts the tasks without their tests or steps (AGENT_TASKS_KEY: the
  steps' names and min_reward), its own step's statement (and solution when the agent is the
  oracle: agent_task's rule) as STEP_DIR/step.json, an empty /tests of its own, the hand-over
  folder, and the gate read-only; never a step's tests, never a later step's statement;
- a grader container (every one but the last) mounts the tasks without any test or step's
  text (GRADER_TASKS_KEY), its own step's
  tests as STEP_DIR/step.json, /tests, the hand-over folder read-only, and the steps' results
  (STATE_DIR) and the gate (GATE_DIR) writable: no agent container mounts the results;
- the Pod's container is the grade-apart grader (the whole tasks file), with step n's tests.
A task with fewer steps leaves the later containers with nothing to do; a task without steps
in such a Pod is run by step 1's agent container and graded by the Pod's container.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from rollout_wire.task_steps import agent_steps
from rollout_wire.tasksets import agent_task, agent_view

# pod_spec's names (not imported: pod_spec is the one to import this module).
AGENT_CONTAINER = "agent"
CONTAINER_NAME = "episode"
AGENT_TASKS_KEY = "tasks-agent.json"
PROGRAM_KEY = "episode.py"
TASKS_KEY = "tasks.json"
# The tasks as a grader of a step other than the last holds them: no task's tests, no step's
# statement, tests or solution (its own step's tests come apart), every env table kept.
GRADER_TASKS_KEY = "tasks-steps-grader.json"
CONFIGMAP_NAME = "episode"
PROGRAM_DIR = "/demo"
# Each step container's own part of the steps (runner/multistep.py STEP_FILE_ENV).
STEP_DIR = "/rollout-step"
STEP_FILE = "step.json"
# Graders only: the steps' results so far; graders writable, agents read-only: the gate.
STATE_DIR = "/rollout-steps"
GATE_DIR = "/rollout-gate"
TESTS_DIR = "/tests"


def step_count(tasks: Sequence[Mapping[str, Any]]) -> int:
    """The most steps a task of `tasks` has (0: none has steps)."""
    return max((len(t.get("steps") or []) for t in tasks), default=0)


def agent_name(number: int) -> str:
    return AGENT_CONTAINER if number == 1 else f"agent-{number}"


def grader_name(number: int, count: int) -> str:
    return CONTAINER_NAME if number == count else f"grade-{number}"


def container_names(count: int) -> list[str]:
    """The Pod's runner containers in the order they run."""
    return [name for n in range(1, count + 1) for name in (agent_name(n), grader_name(n, count))]


def agent_key(number: int) -> str:
    return f"step-{number}-agent.json"


def tests_key(number: int) -> str:
    return f"step-{number}-tests.json"


def _no_steps(view: dict[str, Any]) -> dict[str, Any]:
    """A task's view with its steps' names and min_reward only."""
    return view | {"steps": agent_steps(view["steps"])} if view.get("steps") else view


def agent_tasks(tasks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The tasks as an agent's container holds them (AGENT_TASKS_KEY): agent_task's, and of
    their steps only the names and min_reward; a task with steps without [verifier.env]
    (agent_task keeps it for a runner that runs the tests in its sandbox; here its graders
    do)."""
    views = []
    for task in tasks:
        view = _no_steps(agent_task(task))
        env = {k: v for k, v in (view.get("env") or {}).items() if k != "verifier"}
        if task.get("steps") and "env" in view:
            view = {k: v for k, v in view.items() if k != "env"} | ({"env": env} if env else {})
        views.append(view)
    return views


def step_data(tasks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The ConfigMap keys of the steps: the tasks as a grader of a step holds them
    (GRADER_TASKS_KEY), and per step, {task id: what its agent may hold} (the
    statement and limits; the solution only for the oracle) and {task id: its tests} (the
    tests, min_reward and limits, no statement or solution)."""
    data = {GRADER_TASKS_KEY: orjson.dumps([_no_steps(agent_view(t)) for t in tasks]).decode()}
    for number in range(1, step_count(tasks) + 1):
        agents, graders = {}, {}
        for task in tasks:
            steps = task.get("steps") or []
            if len(steps) < number:
                continue
            step = steps[number - 1]
            hidden = {"tests"} | (set() if task.get("agent") == "oracle" else {"solution"})
            agents[task["id"]] = {k: v for k, v in step.items() if k not in hidden}
            graders[task["id"]] = {
                k: v for k, v in step.items() if k not in ("statement", "solution")
            }
        data[agent_key(number)] = orjson.dumps(agents).decode()
        data[tests_key(number)] = orjson.dumps(graders).decode()
    return data


def _volume(name: str, key: str) -> dict[str, Any]:
    item = {"key": key, "path": STEP_FILE}
    return {"name": name, "configMap": {"name": CONFIGMAP_NAME, "items": [item]}}


def _memory(name: str) -> dict[str, Any]:
    return {"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}


def _env(container: dict[str, Any], number: int, **more: str) -> None:
    values = {
        "ROLLOUT_STEP": str(number),
        "ROLLOUT_STEP_FILE": f"{STEP_DIR}/{STEP_FILE}",
        "ROLLOUT_STEP_GATE_DIR": GATE_DIR,
        **more,
    }
    container["env"] = [*container["env"], *({"name": k, "value": v} for k, v in values.items())]


def chain_steps(pod_spec: dict[str, Any], count: int) -> None:
    """A Pod graded apart (an agent's init container, then the grading container) made into
    `count` steps' agents and graders (see the module's docstring)."""
    agent, grader = pod_spec["initContainers"][-1], pod_spec["containers"][0]
    items = [
        {"key": PROGRAM_KEY, "path": PROGRAM_KEY},
        {"key": GRADER_TASKS_KEY, "path": TASKS_KEY},
    ]
    pod_spec["volumes"] += [
        {"name": "step-program", "configMap": {"name": CONFIGMAP_NAME, "items": items}},
        _memory("step-state"),
        _memory("step-gate"),
    ]
    inits = []
    for number in range(1, count + 1):
        own, theirs = f"step-{number}-agent", f"step-{number}-tests"
        pod_spec["volumes"] += [
            _volume(own, agent_key(number)),
            _volume(theirs, tests_key(number)),
            _memory(f"{own}-tests"),
        ]
        acting = copy.deepcopy(agent)
        acting["name"] = agent_name(number)
        acting["volumeMounts"] = [
            *acting["volumeMounts"],
            {"name": own, "mountPath": STEP_DIR, "readOnly": True},
            {"name": f"{own}-tests", "mountPath": TESTS_DIR},
            {"name": "step-gate", "mountPath": GATE_DIR, "readOnly": True},
        ]
        _env(acting, number)
        inits.append(acting)
        last = number == count
        grading = grader if last else copy.deepcopy(grader)
        grading["name"] = grader_name(number, count)
        grading["volumeMounts"] = [
            *(
                {"name": "step-program", "mountPath": PROGRAM_DIR, "readOnly": True}
                if m["name"] == "program" and not last
                else m
                for m in grading["volumeMounts"]
            ),
            {"name": theirs, "mountPath": STEP_DIR, "readOnly": True},
            {"name": "step-state", "mountPath": STATE_DIR},
            {"name": "step-gate", "mountPath": GATE_DIR},
        ]
        _env(
            grading,
            number,
            ROLLOUT_STEP_STATE_DIR=STATE_DIR,
            **({"ROLLOUT_STEP_LAST": "1"} if last else {}),
        )
        if not last:
            inits.append(grading)
    pod_spec["initContainers"] = [*pod_spec["initContainers"][:-1], *inits]

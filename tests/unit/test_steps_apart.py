"""The runner's part of a task with steps run apart (runner/multistep.py pod_part): the
episode program run once per container of a Pod laid out by kube/pod_steps.py (agent 1,
tests 1, agent 2, the last grader), as the kubelet runs them one after the other, each with
only its own mounts' files. The joined log is one episode's, valid and with the local
backend's row; a gated step leaves the later containers silent; the tests of a step find no
earlier results to tamper with, and what they plant there is not what the next one reads."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rollout_wire.request import parse_spec
from rollout_worker.backends.kube.objects import configmap_manifest
from rollout_worker.sandbox.runner.multistep import add_costs
from tests.unit.test_agent_command import row_of, run_runner

WANT = (
    '#!/bin/bash\ncd "$ROLLOUT_WORKSPACE"\n{extra}'
    'if [ "$(cat step.txt)" = "{want}" ]; then echo 1; else echo 0; fi'
    ' > "$ROLLOUT_VERIFIER_DIR/reward.txt"\n'
)


def task(first_solve: str, min_reward: float | None = None, extra: str = "") -> dict[str, Any]:
    first = {
        "name": "one",
        "statement": "Write one.",
        "tests": {"test.sh": WANT.format(want="one", extra=extra)},
        "solution": {"solve.sh": f"#!/bin/bash\n{first_solve}\n"},
    }
    if min_reward is not None:
        first["min_reward"] = min_reward
    second = {
        "name": "two",
        "statement": "Append two.",
        "tests": {"test.sh": WANT.format(want="one\ntwo", extra="")},
        "solution": {"solve.sh": "#!/bin/bash\necho two >> step.txt\n"},
    }
    return {
        "id": "steps",
        "statement": "Two steps.",
        "files": {},
        "test_command": ["bash", "/tests/test.sh"],
        "reward": "file",
        "baseline": False,
        "agent": "oracle",
        "steps": [first, second],
    }


def run_pod(tmp_path: Path, one: dict[str, Any]) -> tuple[list[list[dict[str, Any]]], str]:
    """Each container's events, and the joined log, of one episode of `one`."""
    spec = parse_spec({"backend": "kubernetes", "tasks": [one]}, max_episodes=10)
    data = configmap_manifest(spec, "program")["data"]
    keys = tmp_path / "keys"
    keys.mkdir()
    for key, text in data.items():
        (keys / key).write_text(text)
    shared = {name: tmp_path / name for name in ("handoff", "state", "gate")}
    for folder in shared.values():
        folder.mkdir()
    (tmp_path / "ws").mkdir()
    common = {
        "ROLLOUT_HANDOFF_DIR": str(shared["handoff"]),
        "ROLLOUT_STEP_GATE_DIR": str(shared["gate"]),
    }
    logs, joined = [], ""
    for number in (1, 2):
        acting = common | {
            "ROLLOUT_TASKS_FILE": str(keys / "tasks-agent.json"),
            "ROLLOUT_STEP": str(number),
            "ROLLOUT_STEP_FILE": str(keys / f"step-{number}-agent.json"),
            "ROLLOUT_GRADER": "sandbox",
        }
        grading = common | {
            "ROLLOUT_TASKS_FILE": str(keys / "tasks-steps-grader.json"),
            "ROLLOUT_STEP": str(number),
            "ROLLOUT_STEP_FILE": str(keys / f"step-{number}-tests.json"),
            "ROLLOUT_STEP_STATE_DIR": str(shared["state"]),
        }
        if number == 2:  # the Pod's container: the whole tasks file, and the report
            grading |= {
                "ROLLOUT_TASKS_FILE": str(tmp_path / "tasks.json"),
                "ROLLOUT_STEP_LAST": "1",
            }
        for env, phase in ((acting, None), (grading, "grade")):
            done, events = run_runner(
                tmp_path, one, phase=phase, extra_env=env, workspace=tmp_path / "ws"
            )
            assert done.returncode == 0, done.stderr
            logs.append(events)
            joined += done.stdout
    return logs, joined


def names(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]


def test_the_containers_make_one_episode_with_the_local_backends_row(tmp_path):
    started = time.time()
    logs, joined = run_pod(tmp_path, task("echo one > step.txt"))
    assert [names(events) for events in logs] == [
        ["ready", "agent_exit"],
        [],
        ["agent_exit"],
        ["reward"],
    ]
    reward = logs[-1][0]
    assert [(s["name"], s["reward"]) for s in reward["step_rewards"]] == [("one", 1), ("two", 1)]
    row = row_of(joined, started)
    assert row.status == "ok", row.errors
    assert row.reward == 1 and [s["reward"] for s in row.step_rewards or []] == [1, 1]
    # The episode's ledger counts every container's reading, not the last one's alone.
    handed = json.loads((tmp_path / "handoff" / "step-agent.json").read_text())["cost"]
    assert handed["cpu_seconds"] > 0
    assert reward["cost"]["cpu_seconds"] > handed["cpu_seconds"]


def test_the_containers_ledgers_add_up():
    own = {"cpu_seconds": 1.0, "peak_memory_bytes": 10, "policy_turns": 1, "cpu_source": "cgroup"}
    agent = {"cpu_seconds": 2.0, "peak_memory_bytes": 30, "policy_turns": 4, "cpu_source": "cgroup"}
    added = add_costs(dict(own), [agent, dict(agent, policy_turns=None)])
    assert added["cpu_seconds"] == 5.0 and added["peak_memory_bytes"] == 30
    assert added["policy_turns"] is None and added["cpu_source"] == "cgroup"
    assert add_costs(dict(own), [None])["cpu_seconds"] is None


def test_a_step_below_its_min_reward_leaves_the_later_containers_silent(tmp_path):
    started = time.time()
    logs, joined = run_pod(tmp_path, task("echo wrong > step.txt", min_reward=1))
    assert [names(events) for events in logs] == [["ready", "agent_exit"], [], [], ["reward"]]
    assert (tmp_path / "ws" / "step.txt").read_text() == "wrong\n"  # step 2's agent never ran
    row = row_of(joined, started)
    assert row.status == "ok", row.errors
    assert row.reward == 0 and [s["name"] for s in row.step_rewards or []] == ["one"]


def test_a_steps_tests_find_no_results_and_what_they_plant_is_replaced(tmp_path):
    """The code under test runs in the grader's container: the results so far are in the
    runner's memory only while the tests run, and a forged file (all steps paid, the gate
    open or closed) is written over once they end."""
    forged = json.dumps({"results": [{"name": "x", "reward": 1}] * 5, "closed": False})
    plant = (
        f'ls -A "{tmp_path}/state" > state-seen.txt\n'
        f"echo '{forged}' > \"{tmp_path}/state/steps.json\"\n"
        f'touch "{tmp_path}/gate/closed"\n'
    )
    started = time.time()
    _, joined = run_pod(tmp_path, task("echo one > step.txt", extra=plant))
    assert (tmp_path / "ws" / "state-seen.txt").read_text() == ""
    row = row_of(joined, started)
    assert row.status == "ok", row.errors
    # The planted gate was opened again (step 2 ran) and the forged results replaced.
    assert [(s["name"], s["reward"]) for s in row.step_rewards or []] == [("one", 1), ("two", 1)]

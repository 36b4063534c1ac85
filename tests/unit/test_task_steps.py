"""Multi-step tasks (`steps`, Harbor's [[steps]]): the Harbor mapping (each step key honoured
or refused by name), the task checks as hostile input, where such tasks may run (never on
Kubernetes or from a warm pool), the strategies, and the row's step_rewards as validation
reads them (end to end: tests/integration/test_harbor_steps.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.harbor import scan
from rollout_wire.request import parse_spec
from rollout_wire.task_steps import (
    agent_steps,
    combine_step_rewards,
    kubernetes_step_problems,
)
from rollout_worker.backends.local.phases import agent_task, hidden_steps_mount
from rollout_worker.sandbox.runner.multistep import combine_rewards, step_limit
from rollout_worker.validation import validate_episode
from tests.unit.test_agent_validation import ORIGIN, agent_log, obs

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "harbor" / "multi-step"


def test_the_fixture_maps_to_a_task_with_two_steps():
    (mapped,) = scan(FIXTURE / "two-steps")
    task = mapped.task
    assert [s["name"] for s in task["steps"]] == ["make-file", "extend-file"]
    first, second = task["steps"]
    assert first["min_reward"] == 1.0 and "min_reward" not in second
    # The task's tests/ under each step's: the shared helper and the step's own test.sh.
    assert set(first["tests"]) == {"reward.sh", "test.sh"}
    assert first["tests"]["test.sh"] != second["tests"]["test.sh"]
    assert set(first["solution"]) == {"solve.sh"}
    assert (first["time_limit_seconds"], second["time_limit_seconds"]) == (20, 30)
    # The episode's budget is the steps' sum; the task has no tests or solution of its own.
    assert (task["time_limit_seconds"], task["test_timeout_seconds"]) == (50, 40)
    assert "tests" not in task and "solution" not in task
    assert task["step_reward_strategy"] == "mean" and task["statement"] == first["statement"]
    spec = parse_spec({"tasks": [task], "agent": "oracle"}, max_episodes=None)
    assert spec.tasks[0]["steps"] == task["steps"]


def harbor_steps(tmp_path: Path, toml: str, **folders: dict[str, str]) -> str:
    """The problems of a task with one step `one` (its folder, unless `folders` says)."""
    folder = tmp_path / "t"
    files = folders or {
        "steps/one/instruction.md": "Do it.\n",
        "steps/one/tests/test.sh": "true\n",
    }
    for rel, text in {"environment/a.txt": "a\n", **files}.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    (folder / "task.toml").write_text(toml)
    with pytest.raises(InvalidSpec) as info:
        scan(folder)
    return " | ".join(info.value.problems)


@pytest.mark.parametrize(
    ("toml", "refused"),
    [
        ("min_reward = { safety = 1 }\n", "min_reward as a table of reward keys"),
        ("[steps.healthcheck]\ncommand = 'true'\n", "a step's healthcheck is not supported"),
        ("artifacts = ['/a']\n", "a step's artifacts are not supported"),
        ("[steps.verifier]\nenv = { K = 'v' }\n", "a step's own [verifier.env]"),
        ("[steps.verifier]\nenvironment_mode = 'separate'\n", "steps share one sandbox"),
        ("[steps.agent]\nuser = 'root'\n", "user = 'root'"),
        ("[steps.agent]\nnetwork_mode = 'public'\n", "network_mode 'public'"),
        ("[steps.agent]\nallowed_hosts = ['x.org']\n", "allowed_hosts"),
        ("[steps.agent]\ntimeout_sec = 'soon'\n", "timeout_sec must be a positive number"),
        ("surprise = 1\n", "unknown key 'surprise'"),
    ],
)
def test_each_step_key_that_cannot_be_honoured_is_refused_by_name(tmp_path, toml, refused):
    text = harbor_steps(tmp_path, '[[steps]]\nname = "one"\n' + toml)
    assert refused in text and "[[steps]] 1 (one)" in text


def test_a_step_folder_is_read_as_hostile_input(tmp_path):
    assert "no steps/one" in harbor_steps(
        tmp_path, '[[steps]]\nname = "one"\n', **{"notes.txt": "x"}
    )
    text = harbor_steps(
        tmp_path / "b",
        '[[steps]]\nname = "one"\n',
        **{"steps/one/instruction.md": "x", "steps/one/workdir/setup.sh": "true\n"},
    )
    assert "steps/one/workdir/ (per-step set-up) is not supported" in text
    assert "no test.sh in steps/one/tests/ or tests/" in text
    bad_name = harbor_steps(tmp_path / "c", '[[steps]]\nname = "../up"\n')
    assert "name '../up' must be a folder name" in bad_name
    strategy = harbor_steps(
        tmp_path / "d", 'multi_step_reward_strategy = "max"\n[[steps]]\nname = "one"\n'
    )
    assert "multi_step_reward_strategy 'max' is not one of ['mean', 'final']" in strategy


def test_a_linked_step_file_is_refused(tmp_path):
    folder = tmp_path / "t"
    (folder / "steps" / "one" / "tests").mkdir(parents=True)
    (folder / "steps" / "one" / "tests" / "test.sh").write_text("true\n")
    (folder / "steps" / "one" / "instruction.md").symlink_to("/etc/passwd")
    (folder / "task.toml").write_text('[[steps]]\nname = "one"\n')
    with pytest.raises(InvalidSpec) as info:
        scan(folder)
    assert "instruction.md is a symbolic link" in " | ".join(info.value.problems)


STEP = {"name": "one", "statement": "Do it.", "tests": {"test.sh": "true\n"}}
TASK: dict[str, Any] = {
    "id": "t",
    "statement": "Do it.",
    "files": {},
    "test_command": ["bash", "/tests/test.sh"],
    "reward": "file",
    "baseline": False,
    "steps": [STEP],
}


def problems_of(**changes: Any) -> str:
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": [TASK | changes]} | changes.pop("request", {}), max_episodes=None)
    return " | ".join(info.value.problems)


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"steps": []}, "steps must be a list of 1..20 steps"),
        ({"steps": [STEP] * 21}, "steps must be a list of 1..20 steps"),
        ({"steps": [STEP, STEP]}, "name 'one' appears twice"),
        ({"steps": [STEP | {"tests": {}}]}, "tests must hold the step's tests"),
        ({"steps": [STEP | {"tests": {"../x": "y"}}]}, "path '../x' must be relative"),
        ({"steps": [STEP | {"statement": " "}]}, "statement must be non-empty text"),
        ({"steps": [STEP | {"min_reward": float("nan")}]}, "min_reward nan must be a finite"),
        ({"steps": [STEP | {"time_limit_seconds": 0}]}, "time_limit_seconds must be an integer"),
        ({"steps": [STEP | {"run_as": "root"}]}, "unknown fields ['run_as']"),
        ({"steps": ["one"]}, "steps[0] must be an object"),
        ({"step_reward_strategy": "max"}, "step_reward_strategy 'max' is not one of"),
        ({"tests": {"test.sh": "true"}}, "tests goes in each step of a task with steps"),
        ({"grade": "fresh"}, "grade: fresh cannot go with steps"),
        ({"baseline": True}, "a task with steps needs baseline: false"),
        ({"agent": "oracle"}, "the oracle agent needs solution/solve.sh in step 'one'"),
    ],
)
def test_a_task_with_bad_steps_is_refused_before_anything_runs(changes, refused):
    assert refused in problems_of(**changes)


def test_strategy_without_steps_is_refused():
    task = {k: v for k, v in TASK.items() if k != "steps"} | {"step_reward_strategy": "mean"}
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": [task]}, max_episodes=None)
    assert "step_reward_strategy needs steps" in " | ".join(info.value.problems)


def test_steps_run_on_kubernetes_but_not_in_their_own_image_nor_from_a_warm_pool():
    task = TASK | {"steps": [STEP | {"solution": {"solve.sh": "true"}}]}
    # Each step's agent and tests in the Pod's containers, over its workspace volume.
    spec = parse_spec(
        {"tasks": [task], "agent": "oracle", "backend": "kubernetes"}, max_episodes=None
    )
    assert spec.tasks[0]["steps"][0]["name"] == STEP["name"]
    # In its own image, its folders are the image's: a second container would not share them.
    own = task | {"image": "rollout.local/harbor-t:1"}
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": [own], "agent": "oracle", "backend": "kubernetes"}, max_episodes=None)
    assert "in their own image" in " | ".join(info.value.problems)
    with pytest.raises(InvalidSpec) as info:
        parse_spec({"tasks": [task], "agent": "oracle", "warm_pool": 1}, max_episodes=None)
    assert "warm_pool cannot go with tasks with steps" in " | ".join(info.value.problems)
    # The Kubernetes backend's check, as a pure function.
    assert kubernetes_step_problems([TASK | {"image": "x"}, {"id": "plain"}])[0].endswith("['t']")
    assert kubernetes_step_problems([TASK, {"id": "plain"}]) == []


@pytest.mark.parametrize(
    ("strategy", "rewards", "expected"),
    [("mean", [1, 0], 0.5), ("final", [1, 0], 0), ("mean", [0.5], 0.5), ("mean", [], 0)],
)
def test_the_strategies_are_harbors(strategy, rewards, expected):
    assert combine_step_rewards(strategy, rewards) == expected
    assert combine_rewards(strategy, rewards) == expected  # the runner's own copy


def test_the_agents_sandbox_holds_the_steps_names_only(tmp_path):
    task = TASK | {"steps": [STEP | {"solution": {"solve.sh": "x"}, "min_reward": 1}]}
    view = agent_task(task)
    assert view["steps"] == agent_steps(task["steps"]) == [{"name": "one", "min_reward": 1}]
    (mount,) = hidden_steps_mount(task, tmp_path, as_root=False)
    assert mount.target == "/sandbox/steps" and mount.writable
    assert (tmp_path / "steps" / "steps.json").read_bytes().count(b"true\\n") == 1
    assert hidden_steps_mount(TASK | {"steps": []}, tmp_path / "none", as_root=False) == []


def step_log(steps: list[dict[str, Any]], reward: float, strategy: str = "mean") -> str:
    fields = {
        "reward": reward,
        "reward_rule": "file",
        "graded_by": "reward_file",
        "grade_cause": None if reward >= 1 else "reward_file",
        "baseline_exit": None,
        "tests_exit": 0,
        "tests_passed": None,
        "tests_total": None,
        "step_rewards": steps,
        "step_reward_strategy": strategy,
    }
    return agent_log(reward=fields)


def one_step(name: str, reward: float) -> dict[str, Any]:
    return {"name": name, "reward": reward, "grade_cause": None, "tests_exit": 0}


def test_the_row_keeps_each_steps_reward():
    steps = [one_step("a", 1), one_step("b", 0)]
    row = validate_episode(obs(), step_log(steps, 0.5), ORIGIN)
    assert row.status == "ok", row.errors
    assert row.step_rewards == steps and row.reward == 0.5
    plain = validate_episode(obs(), agent_log(), ORIGIN)
    assert plain.status == "ok" and plain.step_rewards is None


@pytest.mark.parametrize(
    ("steps", "reward", "strategy", "error"),
    [
        ([one_step("a", 1), one_step("b", 0)], 1.0, "mean", "is not the mean of the steps'"),
        ([one_step("a", 1), one_step("b", 0)], 0.5, "final", "is not the final of the steps'"),
        ([one_step("a", 1)], 1.0, "max", "step_reward_strategy 'max'"),
        ([one_step("a", 1e9)], 1e9, "mean", "step_rewards[0] reward 1000000000.0 is not"),
        ([{"name": "a", "reward": 1}], 1.0, "mean", "step_rewards[0] is not an object"),
        ([], 1.0, "mean", "step_rewards is not a list of 1..20 steps"),
    ],
)
def test_a_forged_step_reward_fails_the_episode(steps, reward, strategy, error):
    row = validate_episode(obs(), step_log(steps, reward, strategy), ORIGIN)
    assert row.status != "ok" and any(error in e for e in row.errors), row.errors


def test_the_steps_share_the_tasks_limits_as_a_budget():
    """The task's time_limit_seconds and test_timeout_seconds bound the episode (its timeout
    was checked against them): a step's own limit is cut to what is left, a step without one
    may use all that is left, and none gets less than a second."""
    name = "time_limit_seconds"
    assert step_limit({name: 30}, name, {name: 20.0}) == 20
    assert step_limit({name: 5}, name, {name: 20.0}) == 5
    assert step_limit({}, name, {name: 12.5}) == 12.5
    assert step_limit({name: 5}, name, {name: -3.0}) == 1


def test_the_report_gives_each_steps_mean_over_the_samples_that_ran_it():
    from rollout_wire.rows import EpisodeRow
    from rollout_worker.backends.base import RunHandle
    from rollout_worker.report import build_report

    task = TASK | {"steps": [STEP, STEP | {"name": "two"}]}
    spec = parse_spec(
        {"tasks": [task], "samples_per_task": 2, "policy": {"url": "http://p:1"}},
        max_episodes=10,
    )

    def row(index: int, steps: list[dict[str, Any]]) -> EpisodeRow:
        e = spec.episode(index)
        reward = combine_step_rewards("mean", [s["reward"] for s in steps])
        return EpisodeRow(
            index=index,
            pod=f"p-{index}",
            status="ok",
            reward=reward,
            task_id=e.task_id,
            sample=e.sample,
            group_id=e.group_id,
            step_rewards=steps,
        )

    rows = [row(0, [one_step("one", 1), one_step("two", 0.5)]), row(1, [one_step("one", 0)])]
    run = RunHandle("local", spec.batch_id, ORIGIN, "p", "local:x")
    report = build_report(spec, rows, run, None, finalized_by="chord", reported_at=ORIGIN)
    (group,) = report["groups"]
    assert group["step_rewards"] == [
        {"name": "one", "runs": 2, "mean": 0.5},
        {"name": "two", "runs": 1, "mean": 0.5},
    ]
    plain = build_report(spec, [], run, None, finalized_by="chord", reported_at=ORIGIN)
    assert "step_rewards" not in plain["groups"][0]  # no sample ran a step

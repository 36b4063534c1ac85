"""Real rollouts, pure parts: trajectory events validated, failures classified, groups built."""

import json

import pytest

from rollout_wire.request import parse_spec
from rollout_wire.rows import EpisodeRow
from rollout_wire.trajectory import MAX_EVENT_BYTES, trajectory_from_log
from rollout_worker.backends.base import RunHandle
from rollout_worker.observation import EpisodeObservation
from rollout_worker.report import build_report, pass_at_k
from rollout_worker.validation import lost_row, validate_episode

ORIGIN = 1000.0
EP = "rollout-b-0"
IDENTITY = {"task_id": "leap-year", "sample": 0, "group_id": "b:leap-year"}


def obs(**changes):
    base = dict(
        index=0,
        episode_id=EP,
        phase="Succeeded",
        created_at=1001.0,
        finished_at=1009.0,
        exit_code=0,
    )
    return EpisodeObservation(**(base | changes))


def step(n, at, **changes):
    event = {
        "event": "step",
        "at": at,
        "episode_id": EP,
        "step": n,
        "actions": [{"tool": "run", "observation": "ok"}],
        "response": {"choices": []},
        **IDENTITY,
    }
    return event | changes


def agent_log(steps=None, reward=None, extra=()):
    ready = {"event": "ready", "at": 1002.0, "episode_id": EP, "mode": "agent", **IDENTITY}
    steps = [step(1, 1003.0), step(2, 1004.0)] if steps is None else steps
    outcome = {
        "event": "reward",
        "at": 1005.0,
        "episode_id": EP,
        "reward": 0.75,
        "reward_rule": "fraction",
        "baseline_exit": 1,
        "tests_exit": 1,
        "tests_passed": 3,
        "tests_total": 4,
        "steps": len(steps),
        "stop_reason": "submit",
        **IDENTITY,
    } | (reward or {})
    lines = [json.dumps(e) for e in (ready, *steps, outcome)] + list(extra)
    return "\n".join(lines) + "\n"


def test_a_partial_reward_is_an_ok_sample_with_its_task_and_group():
    row = validate_episode(obs(), agent_log(), ORIGIN)
    assert row.status == "ok", row.errors
    assert (row.reward, row.steps, row.stop_reason) == (0.75, 2, "submit")
    assert (row.task_id, row.sample, row.group_id) == ("leap-year", 0, "b:leap-year")
    assert (row.tests_passed, row.tests_total) == (3, 4)
    assert row.failure_kind is None


def test_reward_zero_under_rule_all_is_a_sample_not_a_failure():
    log = agent_log(reward={"reward": 0, "reward_rule": "all", "tests_exit": 1})
    row = validate_episode(obs(), log, ORIGIN)
    assert row.status == "ok" and row.reward == 0


GRADED = {"reward": 1, "reward_rule": "all", "tests_exit": 0, "graded_by": "test_results"}


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (agent_log(steps=[step(1, 1003.0, episode_id="rollout-b-7")]), "names episode"),
        (agent_log(steps=[step(1, 1003.0, group_id="b:other")]), "names group_id"),
        (agent_log(steps=[step(2, 1003.0), step(1, 1004.0)]), "out of order"),
        (agent_log(steps=[step(1, 1004.0), step(2, 1003.0)]), "out of time order"),
        (agent_log(steps=[step(1, 1001.0)]), "out of time order"),  # before ready
        (agent_log(reward={"steps": 5}), "reward counts 5 steps"),
        (agent_log(reward={"reward": 1, "reward_rule": "all", "tests_exit": 1}), "tests_exit 1"),
        (agent_log(reward=GRADED | {"reward": 1, "grade_cause": "tests_missing"}), "grade_cause"),
        (agent_log(reward=GRADED | {"reward": 0}), "without a grade_cause"),
        (agent_log(reward=GRADED | {"graded_by": "vibes"}), "graded_by 'vibes'"),
        (agent_log(reward=GRADED | {"reward": 0, "grade_cause": "bad luck"}), "grade_cause 'bad"),
        (agent_log(reward={"reward": 1.5}), "outside 0..1"),
        (
            agent_log(extra=['{"event": "step", "pad": "' + "x" * MAX_EVENT_BYTES + '"}']),
            "oversized",
        ),
    ],
)
def test_bad_trajectory_events_fail_the_episode_with_the_reason(log, expected):
    row = validate_episode(obs(), log, ORIGIN)
    assert row.status == "failed" and row.reward == 0
    assert any(expected in e for e in row.errors), row.errors
    assert row.failure_kind == "episode"


def test_infrastructure_failures_are_marked_and_never_rewards():
    error = {
        "event": "error",
        "at": 1004.0,
        "episode_id": EP,
        "kind": "infrastructure",
        "cause": "policy endpoint unreachable: ConnectionRefusedError",
    }
    ready = {"event": "ready", "at": 1002.0, "episode_id": EP, "mode": "agent", **IDENTITY}
    log = "\n".join(json.dumps(e) for e in (ready, error)) + "\n"
    row = validate_episode(obs(phase="Failed", exit_code=4, reason="Error"), log, ORIGIN)
    assert row.status == "failed" and row.reward == 0
    assert row.failure_kind == "infrastructure"
    assert row.failure_cause.startswith("policy endpoint unreachable")
    # A sandbox that never got ready, a deadline, a lost episode: infrastructure too.
    never = validate_episode(obs(phase="Failed", exit_code=1, reason="Error"), "", ORIGIN)
    assert never.failure_kind == "infrastructure"
    killed = validate_episode(
        obs(phase="Failed", exit_code=137, reason="DeadlineExceeded"),
        agent_log(steps=[])[:200],
        ORIGIN,
    )
    assert killed.failure_kind == "infrastructure"
    assert lost_row(0, EP, "deadline", None).failure_kind == "infrastructure"


def test_the_trajectory_is_read_back_from_the_log():
    trajectory = trajectory_from_log(agent_log())
    assert trajectory["episode_id"] == EP and trajectory["group_id"] == "b:leap-year"
    assert [s["step"] for s in trajectory["steps"]] == [1, 2]
    assert trajectory["outcome"]["reward"] == 0.75


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 1, 4) == 1.0


def test_the_report_groups_samples_per_task_and_keeps_failures_out_of_the_figures():
    tasks = [
        {"id": "a", "statement": "s", "files": {"a.py": ""}, "test_command": ["python"]},
        {"id": "b", "statement": "s", "files": {"b.py": ""}, "test_command": ["python"]},
    ]
    spec = parse_spec(
        {"tasks": tasks, "samples_per_task": 3, "policy": {"url": "http://p:1"}},
        max_episodes=100,
    )

    def row(index, reward, status="ok", kind=None):
        e = spec.episode(index)
        return EpisodeRow(
            index=index,
            pod=f"p-{index}",
            status=status,
            reward=reward,
            task_id=e.task_id,
            sample=e.sample,
            group_id=e.group_id,
            failure_kind=kind,
            failure_cause="policy endpoint timed out" if kind else None,
        )

    rows = [row(0, 1), row(1, 0), row(2, 1), row(3, 0.5), row(4, 0, "failed", "infrastructure")]
    run = RunHandle("local", spec.batch_id, ORIGIN, "p", "local:x")
    report = build_report(spec, rows, run, None, finalized_by="chord", reported_at=ORIGIN)
    a, b = report["groups"]
    assert (a["task_id"], a["samples"], a["rewards"], a["status"]) == (
        "a",
        3,
        [1, 0, 1],
        "complete",
    )
    assert a["mean"] == pytest.approx(2 / 3) and a["std"] == pytest.approx(0.4714, abs=1e-4)
    assert a["pass_at_k"] == {"1": pytest.approx(2 / 3), "2": 1.0, "3": 1.0}
    assert a["group_id"] == f"{spec.batch_id}:a"
    # Group b: one valid sample, one infrastructure failure (not a 0), one never collected.
    assert b["rewards"] == [0.5] and b["valid_samples"] == 1 and b["status"] == "failed"
    assert [(f["index"], f["failure_kind"]) for f in b["failed"]] == [
        (4, "infrastructure"),
        (5, "infrastructure"),
    ]
    assert report["infrastructure_failures"] == 2 and report["episode_failures"] == 0
    assert report["ok"] is False

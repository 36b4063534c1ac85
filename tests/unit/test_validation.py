import json

import pytest

from rollout_worker.observation import EpisodeObservation
from rollout_worker.validation import parse_events, validate_episode

ORIGIN = 1000.0


def obs(**changes):
    base = dict(
        index=0,
        episode_id="rollout-x-0",
        phase="Succeeded",
        created_at=1001.0,
        finished_at=1005.0,
        exit_code=0,
        restart_count=0,
        node="n",
        image_id="i",
    )
    base.update(changes)
    return EpisodeObservation(**base)


def log(ready_at=1002.0, reward_at=1003.0, episode="rollout-x-0", **reward):
    fields = {"reward": 1, "baseline_exit": 1, "tests_exit": 0, "tests_output": "OK"} | reward
    lines = [
        {"event": "ready", "at": ready_at, "episode_id": episode},
        {"event": "reward", "at": reward_at, "episode_id": episode, **fields},
    ]
    return "\n".join(json.dumps(line) for line in lines) + "\n"


def test_a_good_episode_is_ok_with_its_timings():
    row = validate_episode(obs(), log(), ORIGIN)
    assert row.status == "ok" and row.errors == [] and row.reward == 1
    assert row.pod_to_ready_seconds == 1.0
    assert row.batch_to_ready_seconds == 2.0 and row.batch_to_reward_seconds == 3.0


def check(row, fragment):
    assert row.status == "failed" and row.reward == 0, row
    assert any(fragment in e for e in row.errors), row.errors


def test_every_guide_rule_is_enforced():
    check(validate_episode(obs(phase="Failed", reason="Error"), log(), ORIGIN), "phase is Failed")
    check(validate_episode(obs(restart_count=1), log(), ORIGIN), "restarted 1")
    check(validate_episode(obs(exit_code=1), log(), ORIGIN), "exit code 1")
    check(validate_episode(obs(), log(reward=0, tests_exit=1), ORIGIN), "reward is 0")
    check(validate_episode(obs(), log(baseline_exit=0), ORIGIN), "baseline must fail")
    check(validate_episode(obs(), log(episode="other"), ORIGIN), "names episode 'other'")
    check(validate_episode(obs(), log(ready_at=1004.0, reward_at=1003.0), ORIGIN), "time order")
    check(validate_episode(obs(created_at=999.0), log(), ORIGIN), "time order")
    check(validate_episode(obs(), log().splitlines()[0], ORIGIN), "exactly one ready and one")
    check(validate_episode(obs(), log() + log(), ORIGIN), "got 2 ready and 2 reward")
    check(
        validate_episode(obs(), "Traceback (most recent call last)\n" + log(), ORIGIN),
        "not a JSON event",
    )


def test_termination_message_is_cross_checked_with_the_log():
    message = json.dumps(
        {
            "reward": 1,
            "baseline_exit": 1,
            "tests_exit": 0,
            "episode_id": "rollout-x-0",
            "at": 1003.0,
        }
    )
    assert validate_episode(obs(termination_message=message), log(), ORIGIN).status == "ok"
    cut = log().splitlines()[0]
    check(validate_episode(obs(termination_message=message), cut, ORIGIN), "log cut or lost")
    liar = message.replace('"reward": 1', '"reward": 0')
    check(validate_episode(obs(termination_message=liar), log(), ORIGIN), "disagrees")


def test_parse_events_reports_non_events():
    events, problems = parse_events('{"event": "ready"}\n\n[1, 2]\nnot json\n')
    assert len(events) == 1 and len(problems) == 2


# -- real rollouts: policy versions and stale episodes ------------------------------------------
IDENTITY = {"task_id": "leap-year", "sample": 0, "group_id": "b:leap-year"}


def agent_log(versions=("3", "3"), outcome=None, extra=(), episode="rollout-x-0"):
    """ready, one step per version, then the outcome: a reward by default, else `outcome`
    (None for none)."""
    events = [{"event": "ready", "at": 1002.0, "episode_id": episode, "mode": "agent", **IDENTITY}]
    for n, version in enumerate(versions, start=1):
        events.append(
            {
                "event": "step",
                "at": 1002.0 + n * 0.1,
                "episode_id": episode,
                "step": n,
                "actions": [],
                "policy_version": version,
                **IDENTITY,
            }
        )
    reward = {
        "event": "reward",
        "at": 1003.0,
        "episode_id": episode,
        "reward": 1,
        "reward_rule": "all",
        "baseline_exit": 1,
        "tests_exit": 0,
        "steps": len(versions),
        "stop_reason": "submit",
        **IDENTITY,
    }
    events.append(reward if outcome == "reward" else outcome)
    lines = [json.dumps(e) for e in events if e is not None] + list(extra)
    return "\n".join(lines) + "\n"


def stale_event(steps=2, **changes):
    event = {
        "event": "stale",
        "at": 1003.0,
        "episode_id": "rollout-x-0",
        "first_version": "3",
        "version": "6",
        "lag": 3,
        "max_policy_lag": 2,
        "steps": steps,
        **IDENTITY,
        "attempt": 0,
    }
    return event | changes


def test_a_row_keeps_the_first_and_last_policy_version_its_steps_name():
    row = validate_episode(obs(), agent_log(("3", "4"), "reward"), ORIGIN)
    assert row.status == "ok" and row.policy_versions == {"first": "3", "last": "4"}
    row = validate_episode(obs(), agent_log((None, "5", None, "7", None), "reward"), ORIGIN)
    assert row.status == "ok" and row.policy_versions == {"first": "5", "last": "7"}
    row = validate_episode(obs(), agent_log((None, None), "reward"), ORIGIN)
    assert row.status == "ok" and row.policy_versions is None
    assert validate_episode(obs(), log(), ORIGIN).policy_versions is None  # the demo: no steps
    check(validate_episode(obs(), agent_log((3, 3), "reward"), ORIGIN), "expected a string")


def test_a_well_formed_stale_outcome_is_a_stale_row_not_a_failure():
    row = validate_episode(obs(), agent_log(outcome=stale_event()), ORIGIN)
    assert row.status == "stale" and row.status.withdrawn, row.errors
    assert row.errors == [] and row.reward == 0 and row.failure_kind is None
    assert row.failure_cause == "stale: first turn at version 3, policy at 6 (max lag 2)"
    assert (row.steps, row.stop_reason, row.reward_at) == (2, "stale", None)
    assert row.policy_versions == {"first": "3", "last": "3"}
    assert (row.task_id, row.group_id) == ("leap-year", "b:leap-year")


def failed(row, fragment):
    check(row, fragment)
    assert row.failure_kind == "episode"  # a forged outcome is the episode's doing


@pytest.mark.parametrize(
    ("outcome", "extra", "fragment"),
    [
        # A stale episode has no reward: not as an event, not as a field.
        (stale_event(), ["reward"], "1 reward event"),
        (stale_event(reward=1), [], "carries a reward"),
        (stale_event(), ["stale"], "got 2 stale"),
        (stale_event(lag=2), [], "lag 2 is not 6 - 3"),
        (stale_event(version="5", lag=2), [], "within its max_policy_lag 2"),
        (stale_event(first_version="step-3", lag=3), [], "must be integer strings"),
        (stale_event(version=6), [], "must be integer strings"),
        (stale_event(first_version="2", lag=4), [], "not the first step's policy_version"),
        (stale_event(max_policy_lag=-1), [], "max_policy_lag -1"),
        (stale_event(max_policy_lag=None), [], "max_policy_lag None"),
        (stale_event(steps=5), [], "stale counts 5 steps"),
        (stale_event(episode_id="rollout-y-0"), [], "names episode 'rollout-y-0'"),
        (stale_event(group_id="b:other"), [], "names group_id"),
        (stale_event(at=1002.15), [], "earlier than the last step"),
        (stale_event(at=None), [], "no numeric 'at'"),
        (stale_event(at=1009.0), [], "after the sandbox ended"),
    ],
)
def test_a_malformed_stale_outcome_fails_the_row(outcome, extra, fragment):
    more = {
        "reward": json.dumps(
            {"event": "reward", "at": 1003.0, "episode_id": "rollout-x-0", "reward": 1}
        ),
        "stale": json.dumps(stale_event()),
    }
    forged = agent_log(outcome=outcome, extra=[more[e] for e in extra])
    failed(validate_episode(obs(), forged, ORIGIN), fragment)


def test_a_stale_event_outside_a_real_rollout_fails_the_row():
    demo = log() + json.dumps(stale_event()) + "\n"
    failed(validate_episode(obs(), demo, ORIGIN), "without a policy")
    lone = "\n".join(
        json.dumps(e)
        for e in ({"event": "ready", "at": 1002.0, "episode_id": "rollout-x-0"}, stale_event())
    )
    failed(validate_episode(obs(), lone, ORIGIN), "stale event only ends a real rollout")


def test_the_termination_message_of_a_stale_episode_is_cross_checked():
    summary = {
        k: stale_event()[k]
        for k in ("at", "episode_id", "first_version", "version", "lag", "max_policy_lag")
    } | {"stale": True}
    stale_log = agent_log(outcome=stale_event())
    row = validate_episode(obs(termination_message=json.dumps(summary)), stale_log, ORIGIN)
    assert row.status == "stale", row.errors
    liar = json.dumps(summary | {"version": "9"})
    check(validate_episode(obs(termination_message=liar), stale_log, ORIGIN), "disagrees")
    # The log says stale, the message a reward; and the other way round.
    reward_message = json.dumps(
        {"reward": 1, "baseline_exit": 1, "tests_exit": 0, "episode_id": "rollout-x-0"}
    )
    check(
        validate_episode(obs(termination_message=reward_message), stale_log, ORIGIN),
        "does not contain",
    )
    rewarded = agent_log(outcome="reward")
    check(
        validate_episode(obs(termination_message=json.dumps(summary)), rewarded, ORIGIN),
        "reports a stale episode",
    )
    check(validate_episode(obs(termination_message="[1]"), rewarded, ORIGIN), "not a JSON object")


# -- agent commands, the oracle, grading in a fresh sandbox --------------------------------------
def command_events(mode="command", steps=2, reward=None, exit_=None, fresh=False):
    """A command-mode log's events: ready, exchange steps, agent_exit, then the reward (or
    grade_pending, then the grader's ready and reward)."""
    ep = {"episode_id": "rollout-x-0", **IDENTITY}
    events = [{"event": "ready", "at": 1002.0, "mode": mode, **ep}]
    for n in range(1, steps + 1):
        events.append(
            {
                "event": "step",
                "at": 1002.0 + n * 0.1,
                "step": n,
                "request": {"model": "m"},
                "new_messages": [{"role": "user", "content": "go"}],
                "messages_reset": False,
                "response": {"choices": [{"message": {"role": "assistant"}}]},
                "status": 200,
                "error": None,
                "policy_version": "1",
                **ep,
            }
        )
    events.append(
        {
            "event": "agent_exit",
            "at": 1002.5,
            "exit_code": 0,
            "timed_out": False,
            "seconds": 0.3,
            "output_tail": "done",
            **ep,
        }
        | (exit_ or {})
    )
    agent = {
        "steps": steps,
        "stop_reason": "agent_exit",
        "agent_exit_code": 0,
        "agent_output": "done",
        "agent_seconds": 0.3,
        "baseline_exit": None,
    }
    graded = {
        "event": "reward",
        "at": 1003.0,
        "reward": 3.5,
        "reward_rule": "file",
        "reward_details": {"accuracy": 0.5},
        "tests_exit": 0,
        **ep,
    }
    if fresh:
        events += [
            {"event": "grade_pending", "at": 1002.6, **agent, **ep},
            {"event": "ready", "at": 1002.8, "mode": "grade", **ep},
            graded | {"baseline_exit": None} | (reward or {}),
        ]
    else:
        events.append(graded | agent | (reward or {}))
    return events


def lines(events):
    return "\n".join(json.dumps(e) for e in events) + "\n"


@pytest.mark.parametrize("fresh", [False, True])
def test_a_command_episode_fills_the_agent_fields_and_keeps_a_file_reward(fresh):
    row = validate_episode(obs(), lines(command_events(fresh=fresh)), ORIGIN)
    assert row.status == "ok" and row.errors == [], row.errors
    assert (row.reward, row.reward_details) == (3.5, {"accuracy": 0.5})  # not only 0..1
    assert (row.steps, row.stop_reason, row.baseline_exit) == (2, "agent_exit", None)
    assert (row.agent_exit_code, row.agent_output, row.agent_seconds) == (0, "done", 0.3)
    assert row.ready_at == 1002.0 and row.reward_at == 1003.0
    assert row.task_id == "leap-year" and row.policy_versions == {"first": "1", "last": "1"}


def test_an_oracle_episode_has_no_steps_and_a_timed_out_agent_no_exit_code():
    events = command_events(
        mode="oracle",
        steps=0,
        exit_={"exit_code": None, "timed_out": True},
        reward={"stop_reason": "time_limit", "agent_exit_code": None, "steps": 0},
    )
    row = validate_episode(obs(), lines(events), ORIGIN)
    assert row.status == "ok" and row.agent_exit_code is None, row.errors
    assert row.stop_reason == "time_limit" and row.steps == 0


def broken(events, fragment):
    check(validate_episode(obs(), lines(events), ORIGIN), fragment)


def test_a_malformed_command_episode_fails_the_row():
    events = command_events()
    broken([e for e in events if e["event"] != "agent_exit"], "expected one agent_exit")
    broken([*events[:3], events[3], events[3], *events[4:]], "got 2")
    broken(command_events(exit_={"exit_code": None}), "timed_out False")
    broken(command_events(exit_={"exit_code": 0, "timed_out": True}), "timed_out True")
    broken(command_events(exit_={"seconds": -1}), "not a duration")
    broken(command_events(exit_={"at": 1002.15}), "agent_exit event is out of time order")
    broken(command_events(exit_={"group_id": "b:other"}), "agent_exit event names group_id")
    broken(command_events(reward={"agent_exit_code": 1}), "agent_exit says 0")
    broken(command_events(reward={"stop_reason": "time_limit"}), "expected 'agent_exit'")
    broken(command_events(reward={"reward_details": {"a": "x"}}), "reward_details")
    broken(command_events(reward={"reward_rule": "all", "reward": 3.5}), "outside 0..1")
    broken(command_events(reward={"baseline_exit": 0}), "the baseline must fail")
    events = command_events()
    events[1] = events[1] | {"response": "text"}
    broken(events, "is not an object")
    events[1] = events[1] | {"response": None}
    broken(events, "no response and no error")
    events[1] = events[1] | {"error": "policy unreachable", "new_messages": "x"}
    broken(events, "new_messages is neither")
    agent_run = lines(command_events())
    check(validate_episode(obs(), agent_run.replace('"command"', '"agent"'), ORIGIN), "agent_exit")
    demo = log() + json.dumps(command_events()[3]) + "\n"
    check(validate_episode(obs(), demo, ORIGIN), "without an agent command")


def test_a_fresh_graded_log_must_be_the_agents_then_the_graders():
    events = command_events(fresh=True)
    pending, grader, reward = events[-3:]
    head = events[:-3]
    broken([*head, pending], "expected two ready events")  # the grader's log never came
    broken([*head, pending, reward, grader], "comes before the grader's ready")
    broken([*head, pending, grader | {"mode": "command"}, reward], "expected grade")
    broken([*head, pending, grader, head[1], reward], "agent events after grade_pending")
    broken([*head, pending, grader | {"task_id": "other"}, reward], "names task_id")
    broken([*head, pending, grader | {"at": 1002.55}, reward], "time order violated")
    broken([*head, grader, reward], "without the agent sandbox's grade_pending")
    # The agent's sandbox summed up in its termination message; the grader's a reward.
    message = json.dumps({"at": 1002.6, "episode_id": "rollout-x-0", "grade_pending": True})
    row = validate_episode(obs(termination_message=message), lines(events), ORIGIN)
    assert row.status == "ok", row.errors
    plain = lines(command_events())
    check(validate_episode(obs(termination_message=message), plain, ORIGIN), "has none")

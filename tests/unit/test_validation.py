import json

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

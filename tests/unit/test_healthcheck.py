"""A task's healthcheck (Harbor's [environment.healthcheck]): mapped with Harbor's keys and
checked as hostile input, run by the runner in the sandbox before the agent starts until it
passes (failures in the start period not counted), and one that never passes ends the episode
as an infrastructure failure: no reward-0 sample, the agent never started."""

from __future__ import annotations

import time

import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.harbor import scan
from rollout_wire.states import FailureKind
from rollout_wire.task_spec import check_healthcheck
from tests.unit.test_agent_command import row_of, run_runner
from tests.unit.test_harbor import make_task

TASK = {
    "id": "t",
    "statement": "s",
    "files": {},
    "test_command": ["bash", "-c", "test -f done"],
    "agent": "oracle",
    "solution": {"solve.sh": "touch done\n"},
    "baseline": False,
}


def test_harbors_keys_map_onto_the_tasks_healthcheck(tmp_path):
    make_task(
        tmp_path,
        "t",
        toml='[environment.healthcheck]\ncommand = "test -f /x"\ninterval_sec = 0.5\n'
        "timeout_sec = 2\nstart_period_sec = 1\nstart_interval_sec = 0.25\nretries = 4\n",
    )
    (mapped,) = scan(tmp_path)
    assert mapped.task["healthcheck"] == {
        "command": "test -f /x",
        "interval_seconds": 0.5,
        "timeout_seconds": 2,
        "start_period_seconds": 1,
        "start_interval_seconds": 0.25,
        "retries": 4,
    }


def test_an_unknown_key_or_a_value_out_of_bounds_is_refused_by_name(tmp_path):
    make_task(tmp_path / "a", "a", toml='[environment.healthcheck]\ncommand = "x"\nshell = "zsh"\n')
    make_task(tmp_path / "b", "b", toml="[environment.healthcheck]\nretries = 0\n")
    with pytest.raises(InvalidSpec) as refused:
        scan(tmp_path / "a")
    assert "[environment.healthcheck]: unknown keys ['shell']" in str(refused.value)
    with pytest.raises(InvalidSpec) as refused:
        scan(tmp_path / "b")
    said = str(refused.value)
    assert "[environment.healthcheck].command must be a shell command" in said
    assert "[environment.healthcheck].retries must be a number within 1..100" in said


@pytest.mark.parametrize(
    ("check", "wrong"),
    [
        ({"command": ""}, "command"),
        ({"command": "x" * 4097}, "command"),
        ({"command": "true", "interval_seconds": 0}, "interval_seconds"),
        ({"command": "true", "timeout_seconds": 3601}, "timeout_seconds"),
        ({"command": "true", "start_period_seconds": -1}, "start_period_seconds"),
        ({"command": "true", "retries": 1.5}, "retries"),
        ({"command": "true", "retries": True}, "retries"),
        ({"command": "true", "user": "root"}, "must be an object of"),
    ],
)
def test_task_fields_are_bounded(check, wrong):
    problems: list[str] = []
    check_healthcheck(check, "healthcheck", problems)
    assert len(problems) == 1 and wrong in problems[0], problems


def test_the_agent_starts_once_the_check_passes_and_start_period_failures_do_not_count(
    tmp_path,
):
    # Fails twice (inside the start period, where retries = 1 would otherwise end it), then
    # passes; it sees the task's [environment.env].
    check = {
        "command": "n=$(cat count 2>/dev/null || echo 0); echo $((n+1)) > count; "
        '[ "$n" -ge 2 ] && [ "$SHOWN" = yes ]',
        "retries": 1,
        "start_period_seconds": 30,
        "start_interval_seconds": 0.05,
    }
    task = TASK | {"healthcheck": check, "env": {"environment": {"SHOWN": "yes"}}}
    _, events = run_runner(tmp_path, task)
    assert [e["event"] for e in events] == ["ready", "agent_exit", "reward"], events
    assert events[-1]["reward"] == 1
    assert (tmp_path / "ws" / "count").read_text().strip() == "3"


def test_a_check_that_never_passes_is_an_infrastructure_failure_and_no_agent_runs(tmp_path):
    check = {"command": "echo not yet; exit 3", "retries": 2, "interval_seconds": 0.05}
    started = time.time()
    done, events = run_runner(tmp_path, TASK | {"healthcheck": check})
    assert [e["event"] for e in events] == ["error"], events
    assert events[0]["kind"] == "infrastructure"
    assert events[0]["cause"] == (
        "the task's healthcheck did not pass: 2 failure(s) in a row after 2 attempt(s) in 0s, "
        "the last exit status 3: not yet"
    )
    assert not (tmp_path / "ws" / "done").exists()  # the oracle never ran
    row = row_of(done.stdout, started, exit_code=done.returncode)
    assert row.failure_kind == FailureKind.INFRASTRUCTURE and row.reward == 0 and not row.ok


def test_each_attempt_is_cut_at_its_timeout(tmp_path):
    check = {"command": "sleep 30", "retries": 1, "timeout_seconds": 0.5}
    started = time.time()
    _, events = run_runner(tmp_path, TASK | {"healthcheck": check})
    assert time.time() - started < 10
    assert "the last exit status 124" in events[0]["cause"]

"""A task's healthcheck in the grader's sandbox: a `grade: fresh` grader (Harbor's
environment_mode = "separate", a new environment) runs it before the tests, as the agent's
sandbox does before the agent; a `same` grader continues the agent's environment and does not.
The runner runs here without a sandbox, as Kubernetes' grading container runs it: the folders
it shares with the agent's container (ROLLOUT_SHARED_DIRS) are emptied first, so the check
runs in the environment the tests get."""

from __future__ import annotations

import pytest

from tests.red_team import HONEST
from tests.unit.test_agent_command import baseline_of, run_runner
from tests.unit.test_grading import NEVER_ASKED, shipping_task

SHARED_DIRS_ENV = "ROLLOUT_SHARED_DIRS"


def checked_task(command: str, grade: str) -> dict:
    check = {"command": command, "interval_seconds": 0.1, "retries": 2}
    return shipping_task(HONEST, grade=grade, healthcheck=check)


@pytest.mark.parametrize("grade", ["same", "fresh"])
def test_a_fresh_grader_runs_the_check_after_emptying_what_it_shares(tmp_path, grade):
    shared = tmp_path / "shared-tmp"
    trace = shared / "attempts"
    shared.mkdir()
    task = checked_task(f"echo check >> {trace}", grade)
    _, agent_events = run_runner(tmp_path, task, url=NEVER_ASKED)
    assert agent_events[-1]["event"] == ("grade_pending" if grade == "fresh" else "reward")
    trace.write_text("the agent's\n")  # what the agent's container left in the shared /tmp
    env = baseline_of(agent_events[-1]) if grade == "fresh" else {}
    env[SHARED_DIRS_ENV] = str(shared)
    _, events = run_runner(tmp_path, task, phase="grade", extra_env=env)
    assert [e["event"] for e in events] == ["ready", "reward"], events
    assert events[-1]["reward"] == 1
    # fresh: the shared folder emptied, then the check ran once there; same: untouched.
    assert trace.read_text() == ("check\n" if grade == "fresh" else "the agent's\n")


def test_a_check_that_never_passes_in_the_fresh_grader_is_an_infrastructure_failure(tmp_path):
    grading = tmp_path / "grading-now"  # made after the agent's phase: its check passed
    task = checked_task(f"[ ! -e {grading} ] || {{ echo not ready; exit 3; }}", "fresh")
    _, agent_events = run_runner(tmp_path, task, url=NEVER_ASKED)
    assert agent_events[-1]["event"] == "grade_pending", agent_events
    grading.touch()
    done, events = run_runner(
        tmp_path, task, phase="grade", extra_env=baseline_of(agent_events[-1])
    )
    assert done.returncode != 0
    assert [e["event"] for e in events] == ["error"], events  # no tests ran, no reward
    assert events[0]["kind"] == "infrastructure"
    assert events[0]["cause"].startswith("the task's healthcheck did not pass: 2 failure(s)")
    assert events[0]["cause"].endswith("the last exit status 3: not ready"), events[0]

"""Rewards only from tests that really ran: the runner's grader against agents that try to
earn one without fixing the code (exit 0 at import, start-up hooks, a shadowed unittest,
planted bytecode, forged result lines, a daemon that rewrites the tests). Each earns 0 with
the reason on the row; the honest fix earns 1. The runner runs here without a sandbox; the
suite runs the same agents through real sandboxes (tests/integration/test_red_team.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout_wire.tasksets import load_task_set
from tests.red_team import HONEST, PYTEST_COMMAND, PYTEST_TESTS, PYTEST_TRICKS, TRICKS
from tests.runner_program import episode
from tests.unit.test_agent_command import TASK, baseline_of, names, row_of, run_runner


def shipping_task(source: str, **changes):
    task = load_task_set("bundled", ["shipping-boundary"])[0]
    return task | {"agent": {"command": ["python", "-c", source]}} | changes


NEVER_ASKED = "http://127.0.0.1:9"


def graded(tmp_path, task):
    """(the reward event, the validated row) of one episode graded where its agent ran."""
    started = time.time()
    tmp_path.mkdir(exist_ok=True)
    done, events = run_runner(tmp_path, task, url=NEVER_ASKED)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert names(events)[-1] == "reward", events[-1]
    return events[-1], row_of(done.stdout, started)


@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_a_reward_hack_earns_nothing_and_the_row_says_why(tmp_path, trick):
    source, cause = TRICKS[trick]
    outcome, row = graded(tmp_path, shipping_task(source))
    assert outcome["reward"] == 0 and outcome["grade_cause"] == cause, outcome
    assert row.status == "ok" and row.errors == [] and row.reward == 0
    assert (row.graded_by, row.grade_cause, row.tests_promised) == ("test_results", cause, 3)


def test_the_honest_fix_earns_1_counted_by_the_harness(tmp_path):
    outcome, row = graded(tmp_path, shipping_task(HONEST))
    assert (outcome["reward"], outcome["grade_cause"], outcome["graded_by"]) == (
        1,
        None,
        "test_results",
    )
    assert (row.reward, row.tests_passed, row.tests_total, row.tests_promised) == (1, 3, 3, 3)


def test_a_fresh_grader_holds_the_tests_to_the_baseline_of_the_agent_sandbox(tmp_path):
    # The agent's sandbox counted 3 tests before the agent acted; a grader told nothing of it
    # would accept fewer, so the row refuses a grader that does not name the same promise.
    task = shipping_task(HONEST, grade="fresh")
    started = time.time()
    first, agent_events = run_runner(tmp_path, task, url=NEVER_ASKED)
    pending = agent_events[-1]
    assert pending["event"] == "grade_pending" and pending["baseline_tests"] == {
        "collected": 3,
        "skipped": 0,
    }
    told, events = run_runner(tmp_path, task, phase="grade", extra_env=baseline_of(pending))
    assert events[-1]["reward"] == 1 and events[-1]["tests_promised"] == 3
    assert row_of(first.stdout + told.stdout, started).status == "ok"
    untold, events = run_runner(tmp_path, task, phase="grade")
    assert events[-1]["tests_promised"] is None
    row = row_of(first.stdout + untold.stdout, started)
    assert row.status == "failed" and "baseline counted 3" in row.errors[0]


@pytest.mark.parametrize("grade", ["same", "fresh"])
def test_a_grader_sharing_folders_with_the_agent_empties_them_only_when_fresh(tmp_path, grade):
    # A Pod's grading container shares /tmp, /logs and /dev/shm with the agent's (named in
    # ROLLOUT_SHARED_DIRS): `fresh` receives the workspace alone, and no FIFO in it (a test
    # that opens one would hang); `same` finds them as the agent left them.
    task = shipping_task(HONEST, grade=grade)
    _, agent_events = run_runner(tmp_path, task, url=NEVER_ASKED)
    assert agent_events[-1]["event"] == ("grade_pending" if grade == "fresh" else "reward")
    shared = [tmp_path / "shared-tmp", tmp_path / "shared-logs"]
    for folder in shared:
        (folder / "deep").mkdir(parents=True)
        (folder / "deep" / "left.txt").write_text("the agent's")
        (folder / "deep").chmod(0o500)  # an agent may make what it leaves unwritable
        (folder / "top.txt").write_text("the agent's")
    os.mkfifo(tmp_path / "ws" / "pipe")
    env = baseline_of(agent_events[-1]) if grade == "fresh" else {}
    env[episode.SHARED_DIRS_ENV] = ":".join(map(str, shared))
    _, events = run_runner(tmp_path, task, phase="grade", extra_env=env)
    assert events[-1]["reward"] == 1, events[-1]
    left = [sorted(p.name for p in folder.iterdir()) for folder in shared]
    if grade == "fresh":
        assert left == [[], []] and not (tmp_path / "ws" / "pipe").exists()
    else:
        assert left == [["deep", "top.txt"]] * 2 and (tmp_path / "ws" / "pipe").exists()
        for folder in shared:
            (folder / "deep").chmod(0o700)


@pytest.mark.parametrize(
    ("planted", "cause"),
    [
        ({"conftest.py": "import os\nos._exit(0)\n"}, "tests_failed"),
        ({"pytest.ini": "[pytest]\naddopts = --collect-only\n"}, "tests_failed"),
        ({"sub/conftest.py": "import os\nos._exit(0)\n", "sub/__init__.py": ""}, "tests_failed"),
        ({}, "tests_failed"),
    ],
)
def test_pytest_runs_are_counted_and_planted_configuration_never_loads(tmp_path, planted, cause):
    plant = "import os, json\n" + "".join(
        f"os.makedirs(os.path.dirname({p!r}) or '.', exist_ok=True)\n"
        f"open({p!r}, 'w').write({t!r})\n"
        for p, t in planted.items()
    )
    task = shipping_task(
        plant,
        test_files={"test_shipping.py": PYTEST_TESTS},
        test_command=PYTEST_COMMAND,
    )
    outcome, row = graded(tmp_path, task)
    assert outcome["reward"] == 0 and outcome["grade_cause"] == cause, outcome
    assert (row.tests_passed, row.tests_total, row.tests_promised) == (1, 2, 2)
    hooks = {p for p in planted if episode.unasked(p.rsplit("/", 1)[-1])}
    assert hooks <= set(outcome["removed_before_tests"])
    honest, _ = graded(tmp_path / "honest", task | {"agent": {"command": ["python", "-c", HONEST]}})
    assert (honest["reward"], honest["tests_passed"], honest["tests_total"]) == (1, 2, 2)


def pytest_task(source: str):
    return shipping_task(
        source, test_files={"test_shipping.py": PYTEST_TESTS}, test_command=PYTEST_COMMAND
    )


@pytest.mark.parametrize("trick", sorted(PYTEST_TRICKS))
def test_pytest_made_to_report_a_pass_earns_nothing_and_names_what_was_replaced(tmp_path, trick):
    source, cause = PYTEST_TRICKS[trick]
    outcome, row = graded(tmp_path, pytest_task(source))
    assert outcome["reward"] == 0 and outcome["grade_cause"] == cause, outcome
    assert row.status == "ok" and row.reward == 0 and row.grade_cause == cause
    assert "the code under test replaced" in outcome["tests_output"], outcome["tests_output"]


HONEST_PYTEST_SUITE = {
    "conftest.py": "import pytest\n\n\n@pytest.fixture\ndef total():\n    return 99\n",
    "test_shipping.py": PYTEST_TESTS
    + """
import unittest

import pytest


@pytest.mark.parametrize("below", [1, 50, 98])
def test_many(below):
    assert shipping(below) == 10


def test_fixture(total):
    assert shipping(total) == 0


@pytest.mark.xfail(strict=True)
def test_expected_to_fail():
    assert shipping(0) == 0


@pytest.mark.skip(reason="counted as skipped")
def test_skipped():
    pass


class TestCase(unittest.TestCase):
    def test_unittest_style(self):
        self.assertEqual(shipping(100), 0)
""",
}


def test_an_honest_pytest_suite_of_every_kind_is_not_taken_for_tampering(tmp_path):
    # Fixtures, a conftest of the task's, parametrize, xfail, skip and a unittest class: pytest
    # sets its own machinery as it runs, which must not read as the code under test's doing.
    task = shipping_task(HONEST, test_files=HONEST_PYTEST_SUITE, test_command=PYTEST_COMMAND)
    outcome, row = graded(tmp_path, task | {"reward_rule": "fraction"})
    assert outcome["grade_cause"] is None, outcome
    assert (row.reward, row.tests_passed, row.tests_total) == (1, 7, 9), outcome


def test_a_task_script_that_cannot_be_counted_is_graded_by_its_exit_status(tmp_path):
    script = "import sys\nfrom shipping import shipping\nsys.exit(0 if shipping(99) == 0 else 1)\n"
    task = shipping_task(
        HONEST, test_files={"check.py": script}, test_command=["python", "-B", "check.py"]
    )
    outcome, row = graded(tmp_path, task)
    assert (outcome["reward"], outcome["graded_by"], outcome["tests_passed"]) == (
        1,
        "exit_status",
        None,
    )
    assert row.graded_by == "exit_status" and row.tests_total is None


ALL3 = {"collected": 3, "skipped": 0}
RULES = [
    ({"collected": 3, "passed": 3}, ALL3, "all", (1, None)),
    ({"collected": 2, "passed": 2}, ALL3, "all", (0, "tests_missing")),
    ({"collected": 3, "passed": 2, "skipped": 1}, None, "all", (0, "tests_missing")),
    ({"collected": 3, "passed": 2, "skipped": 1}, ALL3 | {"skipped": 1}, "all", (1, None)),
    ({"collected": 3, "passed": 2}, ALL3, "all", (0, "tests_missing")),
    ({"collected": 4, "passed": 3, "failed": 1}, None, "fraction", (0.75, "tests_failed")),
    ({"collected": 2, "passed": 2}, ALL3 | {"collected": 4}, "fraction", (0.5, "tests_missing")),
    ({"collected": 0, "passed": 0}, None, "fraction", (0, "tests_missing")),
]


@pytest.mark.parametrize(("counts", "promise", "rule", "expected"), RULES)
def test_the_rules_over_counted_runs(counts, promise, rule, expected):
    run = episode.TestRun(0, "", episode.GRADED_BY_RESULTS, [counts], True)
    verdict = episode.judge(rule, run, promise)
    assert (verdict["reward"], verdict["grade_cause"]) == expected


def test_a_run_that_never_reported_its_end_or_timed_out_earns_nothing():
    counts = [{"collected": 3, "passed": 3}]
    exited = episode.TestRun(0, "", episode.GRADED_BY_RESULTS, counts, False)
    timed_out = episode.TestRun(124, "", episode.GRADED_BY_RESULTS, counts, True)
    assert episode.judge("fraction", exited, None)["grade_cause"] == "runner_exited"
    assert episode.judge("all", timed_out, None)["reward"] == 0
    assert episode.judge("all", timed_out, None)["grade_cause"] == "tests_timed_out"


def test_only_an_object_equal_to_anything_claims_to_equal_the_harness_stranger():
    # The probe behind the always-equal tricks must not flag what honest tests compare.
    import collections
    import dataclasses
    import datetime
    import decimal
    import fractions
    import re
    import types
    from unittest import mock

    from rollout_worker.sandbox.runner import comparisons

    @dataclasses.dataclass
    class Point:
        x: int

    class Anything:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    class NeverDifferent:
        def __ne__(self, other):
            return False

    honest = [0, "x", 1.5, float("nan"), None, b"", [1, 2], {"a": 1}, Point(1), object()]
    honest += [fractions.Fraction(1, 3), decimal.Decimal("1.0"), datetime.date(2026, 1, 1)]
    honest += [pytest.approx(0.1), pytest.approx([1, 2]), mock.call(1, x=mock.ANY)]
    honest += [mock.Mock(), mock.MagicMock(), re.compile("x"), range(3), types.SimpleNamespace()]
    honest += [collections.Counter("ab"), collections.namedtuple("P", "x")(1), {1}]
    stranger = comparisons.Stranger()
    assert [h for h in honest if comparisons.equal_to_anything(h, stranger)] == []
    cheats = (Anything(), NeverDifferent(), mock.ANY)
    claims = [comparisons.equal_to_anything(v, stranger) for v in cheats]
    assert [c.rsplit(".", 1)[-1] for c in claims] == ["Anything", "NeverDifferent", "_ANY"]
    items = list(comparisons.operands([[1, Anything()], {"k": mock.ANY}]))
    assert [bool(comparisons.equal_to_anything(i, stranger)) for i in items].count(True) == 2


def test_harness_plans_only_commands_it_can_count():
    plan = episode.harness_plan
    assert plan(["python", "-B", "-m", "unittest", "-v"]) == (["-B"], "unittest", ["-v"])
    assert plan(["python3", "-W", "error", "-m", "pytest", "-q"]) == (
        ["-W", "error"],
        "pytest",
        ["-q"],
    )
    assert plan(["python", "-B", "test_x.py", "a"]) == (["-B"], "test_x.py", ["a"])
    for argv in (
        ["bash", "/tests/test.sh"],
        ["python", "-c", "1"],
        ["python", "-I", "-m", "unittest"],
    ):
        assert plan(argv) is None


def test_result_lines_without_the_key_are_ignored():
    import os

    read, write = os.pipe()
    forged = {"run": {"collected": 3, "passed": 3}, "key": "guess"}
    os.write(write, (json.dumps(forged) + "\n" + json.dumps({"key": "k", "end": True})).encode())
    os.close(write)
    assert episode.read_harness(read, "k") == ([], True)


def test_the_wire_and_the_runner_bound_file_rewards_alike():
    from rollout_wire.rows import MAX_FILE_REWARD

    assert episode.MAX_REWARD_MAGNITUDE == MAX_FILE_REWARD
    assert sys.version_info >= (3, 9)


COMMANDS = [
    ["python", "-B", "-m", "unittest", "-v"],
    ["python3", "-W", "error", "-m", "pytest", "-q"],
    ["python", "-B", "test_x.py", "a"],
    ["python", "-X", "dev", "-u", "t.py"],
    ["bash", "/tests/test.sh"],
    ["python", "-c", "1"],
    ["python", "-I", "-m", "unittest"],
    ["python", "-m", "doctest", "x.py"],
    ["python"],
    ["python", "-W"],
]


@pytest.mark.parametrize("argv", COMMANDS)
def test_the_request_and_the_runner_agree_on_what_can_be_counted(argv):
    from rollout_wire.request import countable

    assert countable(argv) == (episode.harness_plan(argv) is not None)


def test_a_fraction_reward_over_a_command_nobody_can_count_is_refused():
    from rollout_wire.errors import InvalidSpec
    from rollout_wire.request import parse_spec

    task = load_task_set("bundled", ["shipping-boundary"])[0] | {"reward": "fraction"}
    policy = {"url": "http://127.0.0.1:9"}
    parse_spec({"tasks": [task], "policy": policy}, max_episodes=None)
    with pytest.raises(InvalidSpec, match="reward fraction needs a test command"):
        parse_spec(
            {"tasks": [task | {"test_command": ["bash", "t.sh"]}], "policy": policy},
            max_episodes=None,
        )


class HugeAnswer(BaseHTTPRequestHandler):
    """A policy that answers every completion with more than a turn may hold."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"choices": [{"message": {"content": "' + b"x" * (9 * 2**20) + b'"}}]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode", ["loop", "command"])
def test_an_oversized_policy_answer_is_the_episodes_turn_not_an_infrastructure_failure(
    tmp_path, mode
):
    # An infrastructure failure is retried and its sample dropped: a policy that could bring
    # one about at will would learn to erase its bad samples.
    server = ThreadingHTTPServer(("127.0.0.1", 0), HugeAnswer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    asks = "import os, urllib.request\n" + (
        "request = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions',"
        " b'{\"messages\": []}', {'Content-Type': 'application/json'})\n"
        "try:\n    urllib.request.urlopen(request, timeout=30)\nexcept Exception as exc:\n"
        "    print('refused', exc)\n"
    )
    task = TASK if mode == "loop" else TASK | {"agent": {"command": ["python", "-c", asks]}}
    started = time.time()
    try:
        done, events = run_runner(tmp_path, task, url=url)
    finally:
        server.shutdown()
    assert done.returncode == 0 and done.stderr == "", done.stderr
    outcome = events[-1]
    assert outcome["event"] == "reward" and outcome["reward"] == 0, outcome
    if mode == "loop":
        assert outcome["stop_reason"] == "response_too_large"
    else:
        step = next(e for e in events if e["event"] == "step")
        assert "exceeds" in step["error"] and "refused HTTP Error 502" in outcome["agent_output"]
    row = row_of(done.stdout, started)
    assert row.status == "ok" and row.reward == 0 and row.failure_kind is None


def test_a_reward_file_planted_by_code_that_then_kills_the_test_script_earns_nothing(tmp_path):
    from tests.unit.test_agent_command import oracle_task

    # The script would write 0 after its check; the code under test writes 1 first and kills
    # the script (its parent) so that it never does.
    check = (
        "#!/bin/bash\n"
        'cd "$ROLLOUT_WORKSPACE"\n'
        "python -B test_calc.py && r=1 || r=0\n"
        'echo $r > "$ROLLOUT_VERIFIER_DIR/reward.txt"\n'
    )
    cheat = (
        "import os, signal\n"
        "open(os.environ['ROLLOUT_VERIFIER_DIR'] + '/reward.txt', 'w').write('1')\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
    )
    solve = f"#!/bin/bash\ncat > calc.py <<'END'\n{cheat}END\n"
    task = oracle_task(check, solution={"solve.sh": solve})
    started = time.time()
    done, events = run_runner(tmp_path, task)
    outcome = events[-1]
    assert (outcome["reward"], outcome["grade_cause"]) == (0, "runner_exited"), outcome
    assert row_of(done.stdout, started).status == "ok"


def test_completions_answered_around_the_recording_make_the_reward_0(tmp_path):
    # The local policy socket counts the completions it answered; an agent that reached it
    # directly got answers the runner never sent, so its trajectory is not what was sampled.
    from dataclasses import replace

    from rollout_worker.cli.policy_server import running
    from rollout_worker.validation import validate_episode
    from tests.unit.test_agent_command import SCRIPT, agent_task

    started = time.time()
    with running(script=SCRIPT) as server:
        done, events = run_runner(tmp_path, agent_task(tmp_path), url=server.url)
    assert events[-1]["reward"] == 1 and events[-1]["cost"]["policy_requests"] == 2
    honest = row_of(done.stdout, started)
    assert honest.reward == 1 and honest.cost["policy_requests"] == 2
    obs = replace(row_obs(started), policy_completions=2)
    assert validate_episode(obs, done.stdout, started - 2).reward == 1
    around = validate_episode(replace(obs, policy_completions=3), done.stdout, started - 2)
    assert (around.status, around.reward, around.grade_cause) == (
        "ok",
        0,
        "unrecorded_completions",
    )


def row_obs(started):
    from rollout_worker.observation import EpisodeObservation
    from tests.unit.test_agent_command import EP

    return EpisodeObservation(
        index=0,
        episode_id=EP,
        phase="Succeeded",
        created_at=started - 1,
        finished_at=time.time() + 1,
        exit_code=0,
    )


HARBOR_CHECK = (
    "#!/bin/bash\n"
    'cd "$ROLLOUT_WORKSPACE"\n'
    "if python3 -B -c 'from calc import add; raise SystemExit(add(2, 3) != 5)'; then\n"
    '    echo 1 > "$ROLLOUT_VERIFIER_DIR/reward.txt"\n'
    "else\n"
    '    echo 0 > "$ROLLOUT_VERIFIER_DIR/reward.txt"\n'
    "fi\n"
)


@pytest.mark.parametrize(
    ("calc", "expected"),
    [
        ("import os\nos._exit(0)\n", (0, "runner_exited")),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", (0, "runner_exited")),
        ("def add(a, b):\n    return a - b\n", (0, "reward_file")),
        ("def add(a, b):\n    return a + b\n", (1, None)),
    ],
)
def test_a_task_script_that_runs_python_earns_nothing_when_that_python_never_ended(
    tmp_path, calc, expected
):
    # The script cannot be counted, but each Python process it starts is watched: one that
    # left by os._exit (its check then "passed") or a signal gives no reward.
    from tests.unit.test_agent_command import oracle_task

    solve = f"#!/bin/bash\ncat > calc.py <<'END'\n{calc}END\n"
    task = oracle_task(HARBOR_CHECK, solution={"solve.sh": solve})
    started = time.time()
    done, events = run_runner(tmp_path, task)
    outcome = events[-1]
    assert (outcome["reward"], outcome["grade_cause"]) == expected, outcome
    assert outcome["graded_by"] == "reward_file"
    assert row_of(done.stdout, started).status == "ok"


def test_a_server_the_task_script_leaves_running_is_not_an_early_exit(tmp_path):
    from tests.unit.test_agent_command import oracle_task

    # The task's own script starts a Python server in the background and never stops it (as
    # web-app tasks do); the grader kills it when the script ends. That kill is the grader's,
    # not code under test leaving before its end: the honest solution keeps its reward 1.
    check = (
        "#!/bin/bash\n"
        'cd "$ROLLOUT_WORKSPACE"\n'
        'python -B -c "import time; time.sleep(60)" &\n'
        "sleep 0.3\n"  # the server has started (and reported its start to the watch)
        "python -B test_calc.py && r=1 || r=0\n"
        'echo $r > "$ROLLOUT_VERIFIER_DIR/reward.txt"\n'
    )
    started = time.time()
    done, events = run_runner(tmp_path, oracle_task(check))
    outcome = events[-1]
    assert (outcome["reward"], outcome["grade_cause"]) == (1, None), outcome
    assert row_of(done.stdout, started).status == "ok"


def test_a_runner_takes_its_hidden_tests_into_memory_and_leaves_no_file(tmp_path, monkeypatch):
    stash = tmp_path / "stash"
    stash.mkdir()
    hidden = stash / "tasks.json"
    hidden.write_text(json.dumps([{"id": "t1", "tests": {"test.sh": "the hidden check"}}]))
    visible = tmp_path / "tasks.json"
    visible.write_text(json.dumps([{"id": "t1", "statement": "s"}]))
    monkeypatch.setenv("ROLLOUT_HIDDEN_TASKS_FILE", str(hidden))
    monkeypatch.setenv("ROLLOUT_TASKS_FILE", str(visible))
    taken = episode.take_hidden_tests()
    assert not hidden.exists()
    task = episode.load_task({"task_id": "t1"}, taken)
    assert task == {"id": "t1", "statement": "s", "tests": {"test.sh": "the hidden check"}}
    # A stash the runner cannot remove: no task, so no agent ever runs beside the file.
    hidden.write_text("[]")
    stash.chmod(0o500)
    try:
        if os.access(stash, os.W_OK):  # root ignores the mode: make the file unremovable
            monkeypatch.setattr(episode.os, "unlink", _refuse)
        with pytest.raises(episode.InfrastructureError, match="out of reach"):
            episode.take_hidden_tests()
    finally:
        stash.chmod(0o700)


def _refuse(path):
    raise PermissionError(13, "Permission denied", path)


def test_a_warm_sandbox_keeps_its_handed_over_tests_in_memory_only(tmp_path, monkeypatch):
    import io

    from rollout_wire.request import parse_spec
    from rollout_worker.backends import warm

    task = {
        "id": "t1",
        "statement": "s",
        "files": {"a.py": "x = 1\n"},
        "tests": {"test.sh": "the hidden check"},
        "solution": {"solve.sh": "the answer"},
        "test_command": ["bash", "/tests/test.sh"],
        "reward": "file",
        "agent": {"command": ["python", "-c", "pass"]},
    }
    spec = parse_spec(
        {"backend": "kubernetes", "tasks": [task], "policy": {"url": "http://10.0.0.5:8000"}},
        max_episodes=10,
    )
    handover = json.loads(warm.handover_line(spec, 0))
    tasks_file = tmp_path / "tasks.json"
    handover["env"]["ROLLOUT_TASKS_FILE"] = str(tasks_file)  # not the sandbox's /tmp
    monkeypatch.setattr(episode, "HANDED_TESTS", {})
    monkeypatch.delenv("ROLLOUT_HIDDEN_TASKS_FILE", raising=False)
    for name in handover["env"]:
        monkeypatch.setenv(name, "")  # take_handover sets them; monkeypatch restores them
    assert episode.take_handover(io.StringIO(json.dumps(handover) + "\n"))
    written = tasks_file.read_text()
    assert "the hidden check" not in written and "the answer" not in written
    assert episode.take_hidden_tests() == {"t1": {"test.sh": "the hidden check"}}

"""bench_slots' distinct batch (benchmarks/distinct_tasks.py, issue 46's 164 tasks) without a
cluster: the tasks are distinct, each one's hidden tests fail on its file as given and pass with
the scripted policy's answer (run for real), the product accepts the batch, the runner grades a
generated task's episode 1 with the scripted policy and 0 without its answer, a round checks its
episodes, and the command line refuses what it cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_slots
from benchmarks.distinct_tasks import (
    FAMILIES,
    MAX_DISTINCT,
    TESTS_DIR,
    Generated,
    distinct_problems,
    distinct_tasks,
    policy_script,
)
from benchmarks.pod_floor import Floor
from rollout_wire.request import parse_spec
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.cli.policy_server import ScriptedPolicy, bundled_script, running
from rollout_worker.settings import Settings
from tests.unit.test_agent_command import row_of, run_runner
from tests.unit.test_bench_burst import FakeSide, parse_error

BATCH = distinct_tasks(164)


def test_164_distinct_tasks_each_its_own_function() -> None:
    ids = {g.task["id"] for g in BATCH}
    paths = {g.path for g in BATCH}
    functions = {g.solution.split("(", 1)[0] for g in BATCH}
    statements = {g.task["statement"] for g in BATCH}
    assert len(ids) == len(paths) == len(functions) == len(statements) == 164
    assert all(g.task["files"].keys() == {g.path} for g in BATCH)  # one file each
    assert len({g.solution for g in BATCH}) == 164
    assert len({next(iter(g.task["tests"].values())) for g in BATCH}) == 164
    # Every family's first ten parameters, then fourteen of the fifteen families' eleventh.
    assert MAX_DISTINCT == 15 * 12 and len(FAMILIES) == 15
    assert BATCH[0].task["id"] == "t000-sum-multiples-of-2"
    assert BATCH[149].task["id"] == "t149-fibonacci-mod-11"
    assert BATCH[163].task["id"] == "t163-reverse-words-by-hash"
    missing = [g for g in BATCH if "raise NotImplementedError" in g.task["files"][g.path]]
    assert len(missing) == 41 and all("not written yet" in g.task["statement"] for g in missing)
    # The tests are hidden (placed only after the agent ends), counted by the harness.
    assert all(
        "test_files" not in g.task and g.task["test_command"][3] == "unittest" for g in BATCH
    )
    assert all(g.tests >= 3 for g in BATCH)
    assert distinct_tasks(5) == BATCH[:5]


@pytest.mark.parametrize("count", [0, MAX_DISTINCT + 1])
def test_the_generator_refuses_a_count_out_of_bounds(count: int) -> None:
    with pytest.raises(ValueError, match=f"--distinct makes 1..{MAX_DISTINCT} tasks"):
        distinct_tasks(count)


# Runs each task's tests, its folder holding its one file, where a test command over /tests
# would: the file's folder first on the path, the tests found in their own folder. One
# interpreter for all 164 (every module has its own name), each task's modules dropped after it.
DRIVER = """
import json, sys, unittest
from pathlib import Path

out = {}
for folder in sorted(Path(sys.argv[1]).iterdir()):
    tests = folder / "tests"
    sys.path[:0] = [str(folder / "ws"), str(tests)]
    suite = unittest.defaultTestLoader.discover(str(tests), top_level_dir=str(tests))
    result = unittest.TestResult()
    suite.run(result)
    out[folder.name] = [result.testsRun, len(result.failures) + len(result.errors)]
    del sys.path[:2]
print(json.dumps(out))
"""


def run_all(batch: list[Generated], root: Path, answered: bool) -> dict[str, list[int]]:
    """{task id: [tests run, tests failed]} with each task's file as given or as answered."""
    for g in batch:
        folder = root / g.task["id"]
        (folder / "ws").mkdir(parents=True)
        (folder / "tests").mkdir()
        (folder / "ws" / g.path).write_text(g.solution if answered else g.task["files"][g.path])
        for name, text in g.task["tests"].items():
            (folder / "tests" / name).write_text(text)
    done = subprocess.run(
        [sys.executable, "-B", "-c", DRIVER, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_each_task_s_hidden_tests_fail_on_its_file_and_pass_with_the_answer(
    tmp_path: Path,
) -> None:
    given = run_all(BATCH, tmp_path / "given", answered=False)
    answered = run_all(BATCH, tmp_path / "answered", answered=True)
    for g in BATCH:
        tid = g.task["id"]
        assert given[tid][0] == g.tests and given[tid][1] >= 1, tid
        assert answered[tid] == [g.tests, 0], tid


@pytest.mark.parametrize(
    ("backend", "extra"),
    [("kubernetes", {"isolation": "host"}), ("kubernetes", {}), ("local", {})],
)
def test_the_batch_is_one_the_product_accepts(backend: str, extra: dict[str, Any]) -> None:
    request = {
        "tasks": [g.task for g in BATCH],
        "samples_per_task": 1,
        "parallelism": 10,
        "policy": {"url": "http://127.0.0.1:9"},
        "backend": backend,
        **extra,
    }
    spec = parse_spec(request, max_episodes=Settings().max_batch_episodes)
    assert spec.count == 164 and [t["id"] for t in spec.tasks] == [g.task["id"] for g in BATCH]


def test_the_scripted_policy_writes_each_task_s_answer_then_submits() -> None:
    policy = ScriptedPolicy(policy_script(BATCH))
    for g in (BATCH[0], BATCH[3], BATCH[163]):
        first = policy.turn(g.task["id"], 0, 0)
        assert first == {
            "tool": "write_file",
            "arguments": {"path": g.path, "content": g.solution},
        }
        assert policy.turn(g.task["id"], 0, 1)["tool"] == "submit"
    # The warm-up batches' bundled tasks keep their plans.
    bundled = bundled_script()["tasks"]
    assert all(policy.tasks[t] == bundled[t] for t in bundled)


def episode_of(tmp_path: Path, g: Generated, script: dict[str, Any]) -> Any:
    """The runner's episode of `g` (its tests at a stand-in /tests) with the scripted policy
    on a real port; the row validation makes of its log."""
    started = time.time()
    with running(script=script) as server:
        done, _ = run_runner(tmp_path, g.task, url=server.url)
    assert done.returncode == 0, done.stderr
    return row_of(done.stdout, started)


@pytest.mark.parametrize("number", [0, 3, 12, 13])  # sums, a missing one, digits, words
def test_the_runner_grades_a_generated_task_1_with_the_policy_s_answer(
    tmp_path: Path, number: int
) -> None:
    g = BATCH[number]
    assert TESTS_DIR in g.task["test_command"]
    row = episode_of(tmp_path, g, policy_script(BATCH))
    assert row.status == "ok" and row.reward == 1, row.errors
    assert (row.tests_passed, row.tests_total) == (g.tests, g.tests)
    assert row.graded_by == "test_results" and row.baseline_exit is None
    assert (tmp_path / "ws" / g.path).read_text() == g.solution


def test_the_runner_grades_a_generated_task_0_without_it(tmp_path: Path) -> None:
    """A policy that submits the file as given earns nothing: the tests check the code."""
    g = BATCH[1]
    row = episode_of(tmp_path, g, bundled_script())
    assert row.status == "ok" and row.reward == 0
    assert row.tests_total == g.tests and row.tests_passed is not None
    assert row.tests_passed < g.tests


def row(g: Generated, index: int, **changes: Any) -> dict[str, Any]:
    good = {"index": index, "task_id": g.task["id"], "reward": 1.0}
    return good | {"tests_passed": g.tests, "tests_total": g.tests} | changes


def test_distinct_problems_name_each_episode_not_as_built() -> None:
    three = BATCH[:3]
    good = [row(g, i) for i, g in enumerate(three)]
    assert distinct_problems({"pods": good}, three) == []
    a, b, c = three
    got = distinct_problems(
        {"pods": [row(a, 0, reward=0.0, tests_passed=0), row(b, 1, tests_passed=b.tests - 1)]},
        three,
    )
    assert got == [
        f"task {c.task['id']}: 0 episodes, not 1",
        f"episode 0: reward 0.0, tests passed 0 of {a.tests} (task {a.task['id']})",
        f"episode 1: reward 1.0, tests passed {b.tests - 1} of {b.tests} (task {b.task['id']})",
    ]
    twice = distinct_problems({"pods": [*good, row(a, 3)]}, three)
    assert twice == [f"task {a.task['id']}: 2 episodes, not 1"]
    # Every test counted, but fewer than the task has: its tests did not all run.
    short = row(c, 2, tests_passed=1, tests_total=1)
    assert distinct_problems({"pods": [*good[:2], short]}, three) == [
        f"episode 2: reward 1.0, tests passed 1 of 1 (task {c.task['id']})"
    ]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--distinct", "0"], f"--distinct must be within 1..{MAX_DISTINCT} tasks, got 0"),
        (["--distinct", "181"], f"--distinct must be within 1..{MAX_DISTINCT} tasks, got 181"),
        (["--distinct", "164", "--burst", "164"], "--distinct and --burst are two batches"),
        (["--distinct", "164", "--samples", "2"], "--distinct runs one sample of each task"),
        (["--distinct", "5"], "--parallelism must be within 1..--distinct (5)"),
        (["--distinct"], "--distinct: expected one argument"),
    ],
)
def test_what_distinct_cannot_run_is_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in parse_error(argv, capsys)


def test_the_distinct_batch_s_arguments() -> None:
    args = bench_slots.parse_args(["--distinct", "164", "--sides", "hosts,local"])
    assert (args.distinct, args.burst, args.sides) == (164, None, ["hosts", "local"])
    tasks, samples, extra = bench_slots.timed_batch(args)
    assert (tasks, samples, extra) == ([g.task for g in BATCH], 1, {})
    # The default batch as it was, its policy the bundled script.
    args = bench_slots.parse_args([])
    assert (args.distinct, args.samples) == (None, 18)
    assert bench_slots.timed_batch(args) == (bundled_tasks(), 18, {})
    rounds = bench_slots.Rounds(args, Floor(per_pod=0.5, pods_own=0.0, idle_cores=0.0, daemons={}))
    assert rounds.script == bundled_script()


class DistinctSide(FakeSide):
    """FakeSide's batch, each row one task's episode graded by all its tests (or `short` of
    them for the first row)."""

    def __init__(self, name: str, wall: float, short: int = 0) -> None:
        super().__init__(name, wall)
        self.short = short

    def batch(
        self, parallelism: int, timeout: float = 1800, **extra: Any
    ) -> tuple[dict[str, Any], float, float]:
        report, wall, clock = super().batch(parallelism, timeout, **extra)
        for number, (task, got) in enumerate(zip(extra["tasks"], report["pods"], strict=True)):
            tests = len(next(iter(task["tests"].values())).split("def test_case_")) - 1
            passed = tests - self.short if number == 0 else tests
            got |= {"task_id": task["id"], "tests_passed": passed, "tests_total": tests}
        return report, wall, clock


def test_distinct_rounds_print_issue_46_s_first_goal(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_slots.parse_args(["--distinct", "20", "--sides", "hosts,local"])
    rounds = bench_slots.Rounds(args, Floor(per_pod=0.5, pods_own=0.0, idle_cores=0.0, daemons={}))
    hosts, local = DistinctSide("hosts", 13.0), DistinctSide("local", 10.0)
    for number in range(3):
        rounds.round(number, [hosts, local])
    asked = hosts.asked[0]
    assert asked["samples_per_task"] == 1 and len(asked["tasks"]) == 20
    assert "deadline_seconds" not in asked and local.asked[0]["warm_pool"] == 10
    rounds.print_summary(["hosts", "local"])
    out = capsys.readouterr().out
    assert "round 1 hosts / local: 1.30" in out
    assert (
        "goal issue 46 batch: hosts' wall at most 1.3x local's (hosts / local <= 1.30): met (1.30)"
    ) in out
    assert (
        "goal issue 46 batch: hosts' CPU at most 1.2x local's (hosts / local machine CPU <= 1.20)"
        ": met (1.00)"
    ) in out
    assert "goal burst" not in out and "pods slot utilisation" not in out


def test_a_distinct_round_whose_tests_did_not_all_run_fails() -> None:
    args = bench_slots.parse_args(["--distinct", "4", "--parallelism", "2", "--sides", "hosts"])
    rounds = bench_slots.Rounds(args, Floor(per_pod=0.5, pods_own=0.0, idle_cores=0.0, daemons={}))
    with pytest.raises(RuntimeError, match=r"hosts: 1 problems: \['episode 0: reward 1.0"):
        rounds.round(0, [DistinctSide("hosts", 9.0, short=1)])

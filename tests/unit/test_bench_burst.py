"""bench_slots' burst mode (benchmarks/burst_tasks.py, issue 46) without a cluster: the batch it
submits is one the product accepts and its test really sleeps then grades; the command line
refuses what it cannot run; the goal line's arithmetic."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_slots
from benchmarks.burst_tasks import (
    MAX_BURST,
    TEST_FILE,
    burst_limits,
    burst_problems,
    burst_task,
    burst_tasks,
    grading_seconds,
    split,
)
from benchmarks.pod_floor import Floor
from benchmarks.slot_hosts import BURST_GOALS, goal_lines, ratios
from rollout_wire.request import MAX_SAMPLES_PER_TASK, parse_spec
from rollout_wire.tasksets import bundled_tasks
from rollout_worker.settings import Settings


def test_a_burst_of_1000_is_a_batch_the_product_accepts() -> None:
    tasks, samples = burst_tasks(1000, 1.0)
    assert (len(tasks), samples) == (4, 250)
    limits = burst_limits(tasks, 1000, 10, 1.0)
    request: dict[str, Any] = {
        "tasks": tasks,
        "samples_per_task": samples,
        "parallelism": 10,
        "policy": {"url": "http://127.0.0.1:9"},
        "backend": "kubernetes",
        "isolation": "host",
        **limits,
    }
    spec = parse_spec(request, max_episodes=Settings().max_batch_episodes)
    assert spec.count == 1000
    assert spec.deadline_seconds == 600 + 3 * 1000
    # The agent's 60 s, the test's own limit (61 s) and the set-up margin.
    assert spec.episode_timeout_seconds == 60 + 61 + 60
    assert [t["id"] for t in spec.tasks] == ["burst-0", "burst-1", "burst-2", "burst-3"]


@pytest.mark.parametrize(
    ("episodes", "want"),
    [(1, (1, 1)), (256, (1, 256)), (257, (257, 1)), (1000, (4, 250)), (999, (9, 111))],
)
def test_split_is_exact_and_within_the_samples_limit(episodes: int, want: tuple[int, int]) -> None:
    tasks, samples = split(episodes)
    assert (tasks, samples) == want
    assert tasks * samples == episodes and samples <= MAX_SAMPLES_PER_TASK


@pytest.mark.parametrize("episodes", [0, MAX_BURST + 1])
def test_split_refuses_a_burst_out_of_bounds(episodes: int) -> None:
    with pytest.raises(ValueError, match="a burst holds"):
        split(episodes)


def run_task(task: dict[str, Any], where: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """The task's test command on its files, as the sandbox's runner would (python -> ours)."""
    for name, text in {**task["files"], **task["test_files"]}.items():
        (where / name).write_text(text)
    argv = [sys.executable if a == "python" else a for a in task["test_command"]]
    start = time.monotonic()
    done = subprocess.run(argv, cwd=where, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - start


def test_the_test_sleeps_the_episode_s_seconds_then_passes(tmp_path: Path) -> None:
    task = burst_task("burst-0", 0.7)
    assert task["test_files"][TEST_FILE].count("time.sleep(SECONDS)") == 1
    assert "SECONDS = 0.7\n" in task["test_files"][TEST_FILE]
    done, took = run_task(task, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Ran 1 test" in done.stderr and took >= 0.7


def test_the_test_grades_the_code(tmp_path: Path) -> None:
    """A wrong answer fails it: the reward is earned by the code, not by the sleep."""
    task = burst_task("burst-0", 0.1)
    task["files"] = {"burst.py": "def answer():\n    return 41\n"}
    done, _ = run_task(task, tmp_path)
    assert done.returncode != 0 and "FAILED (failures=1)" in done.stderr


def test_burst_problems_name_an_ungraded_or_short_episode() -> None:
    graded = {"reward": 1.0, "tests_passed": 1, "tests_total": 1}
    good = {"index": 0, **graded, "cost": {"wall": {"tests": 1.3}}}
    zero = {"index": 1, "reward": 0.0, "tests_passed": 0, "tests_total": 1}
    short = {"index": 2, **graded, "cost": {"wall": {"tests": 0.4}}}
    assert burst_problems({"pods": [good]}, 1.0) == []
    got = burst_problems({"pods": [good, zero, short]}, 1.0)
    assert got == [
        "episode 1: reward 0.0, tests passed 0 of 1",
        "episode 2: its tests took 0.40 s, under 1.0 s",
    ]
    assert grading_seconds({"pods": [good, zero, short]}) == 0.4  # the lower median of two
    assert grading_seconds({"pods": [zero]}) is None


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench_slots.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_burst_needs_its_number(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["--burst"], capsys)
    assert "--burst: expected one argument" in err


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "601"])
def test_episode_seconds_must_be_positive(seconds: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["--burst", "100", "--episode-seconds", seconds], capsys)
    assert "--episode-seconds must be above 0 and at most 600" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--episode-seconds", "1"], "--episode-seconds needs --burst"),
        (["--burst", "0"], "--burst must be within 1.."),
        (["--burst", "5", "--parallelism", "10"], "--parallelism must be within 1..--burst (5)"),
        (["--sides", "pods,nodes"], "--sides 'pods,nodes': name one or more of pods,hosts,local"),
        (["--sides", ","], "--sides ',': name one or more"),
    ],
)
def test_what_cannot_run_is_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in parse_error(argv, capsys)


def test_the_default_batch_is_unchanged() -> None:
    args = bench_slots.parse_args([])
    assert (args.burst, args.episode_seconds, args.sides) == (
        None,
        None,
        ["pods", "hosts", "local"],
    )
    tasks, samples, extra = bench_slots.timed_batch(args)
    assert (tasks, samples, extra) == (bundled_tasks(), 18, {})


def test_a_burst_s_arguments() -> None:
    args = bench_slots.parse_args(["--burst", "1000", "--sides", "hosts,pods"])
    assert (args.burst, args.episode_seconds, args.sides) == (1000, 1.0, ["pods", "hosts"])
    tasks, samples, extra = bench_slots.timed_batch(args)
    assert (len(tasks), samples) == (4, 250)
    assert extra == {"episode_timeout_seconds": 181, "deadline_seconds": 3600}


def test_the_burst_goal_line() -> None:
    # Round walls of pods 300 s and hosts 100 s: hosts exactly 3x faster, the goal met.
    median = ratios({"pods": 300.0, "hosts": 100.0}, {})["pods / hosts"]
    assert goal_lines({"pods / hosts": median}, BURST_GOALS) == [
        "goal burst: hosts >= 3x faster than pods (pods / hosts >= 3.00): met (3.00)"
    ]
    assert goal_lines({"pods / hosts": 2.99}, BURST_GOALS) == [
        "goal burst: hosts >= 3x faster than pods (pods / hosts >= 3.00): MISSED (2.99)"
    ]
    # Without the pods side the burst's goal is not judged, and not among the default goals.
    assert goal_lines({"hosts / local": 1.0}, BURST_GOALS) == []
    assert goal_lines({"pods / hosts": 5.0}) == []


class FakeSide:
    """A side as Rounds drives it (bench_slots.Side), its batch a report made up here: every
    episode graded 1 after `tests` seconds of grading, the batch `wall` seconds long."""

    def __init__(self, name: str, wall: float, tests: float = 1.2) -> None:
        self.name, self.wall, self.tests = name, wall, tests
        self.hosts = object() if name == "hosts" else None
        self.asked: list[dict[str, Any]] = []

    def pool_ready(self, size: int) -> None:
        pass

    def batch(
        self, parallelism: int, timeout: float = 1800, **extra: Any
    ) -> tuple[dict[str, Any], float, float]:
        self.asked.append({"parallelism": parallelism, "timeout": timeout, **extra})
        count = len(extra["tasks"]) * extra["samples_per_task"]
        clock = time.time()
        rows = [
            {
                "index": i,
                "reward": 1.0,
                "tests_passed": 1,
                "tests_total": 1,
                "created_at": clock,
                "ready_at": clock + 0.5,
                "finished_at": clock + 2.0,
                "timing": {},
                "cost": {"cpu_seconds": 0.1, "wall": {"tests": self.tests}},
            }
            for i in range(count)
        ]
        return {"batch_id": "b", "pods": rows}, self.wall, clock

    def machine_cpu(self, idle_cores: float) -> float:
        return 3.0


def test_burst_rounds_print_the_goal(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_slots.parse_args(["--burst", "6", "--parallelism", "2", "--sides", "pods,hosts"])
    floor = Floor(per_pod=0.5, pods_own=0.0, idle_cores=0.0, daemons={})
    rounds = bench_slots.Rounds(args, floor)
    pods, hosts = FakeSide("pods", 30.0), FakeSide("hosts", 9.0)
    for number in range(3):
        rounds.round(number, [pods, hosts])
    asked = hosts.asked[0]
    assert asked["samples_per_task"] == 6 and asked["deadline_seconds"] == 600 + 18
    assert asked["timeout"] == 600 + 18 + 300 and "warm_pool" not in asked
    assert pods.asked[0]["warm_pool"] == 2
    rounds.print_summary(["pods", "hosts"])
    out = capsys.readouterr().out
    assert "round 1 pods / hosts: 3.33" in out
    assert "goal burst: hosts >= 3x faster than pods (pods / hosts >= 3.00): met (3.33)" in out
    assert "burst: no side can take less than 6 x 1.0 s / 2 slots = 3.0 s" in out
    assert rounds.figures.median("hosts episodes per s") == pytest.approx(6 / 9.0)
    assert rounds.figures.median("pods grading s per episode") == pytest.approx(1.2)


def test_a_burst_round_whose_grading_is_short_fails() -> None:
    args = bench_slots.parse_args(["--burst", "4", "--parallelism", "2", "--sides", "hosts"])
    rounds = bench_slots.Rounds(args, Floor(per_pod=0.5, pods_own=0.0, idle_cores=0.0, daemons={}))
    with pytest.raises(RuntimeError, match="4 episodes not as built"):
        rounds.round(0, [FakeSide("hosts", 9.0, tests=0.2)])

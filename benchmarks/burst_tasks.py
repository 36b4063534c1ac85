"""bench_slots' burst (issue 46: "a burst of 1,000 one-second episodes on the real node: hosts
finish it at least 3x faster than one Pod per episode"): the batch it submits, built here in
process, nothing downloaded.

Each episode takes about `seconds` of wall time in its sandbox and earns its reward through real
grading: the task's test sleeps `seconds`, then checks the repository's one function; the
scripted policy knows no burst task, so its agent submits at once, untouched code that passes
(`baseline: false`: the tests pass before the agent acts, by design). A batch holds at most
MAX_SAMPLES_PER_TASK samples of a task, so the burst is a few copies of the task under their own
ids (tasks x samples = the burst, exactly). Its deadline is generous for a slow side (three
times the episodes' seconds, each counted at least 1 s, plus 10 minutes: an hour for 1,000
one-second episodes) yet ends a stalled burst there, not after the hours its waves' worst case
(task_limits) would allow.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_wire.request import MAX_SAMPLES_PER_TASK
from rollout_wire.task_spec import MAX_TASKS
from rollout_wire.tasksets import task_limits
from rollout_worker.settings import Settings

TASK_PREFIX = "burst"
TEST_FILE = "test_burst.py"
ANSWER = 42
# The most a burst may hold: a batch's own limits, and the workers' default batch limit
# (ROLLOUT_MAX_BATCH_EPISODES, which bench_slots' stacks leave as it is).
MAX_BURST = min(MAX_TASKS * MAX_SAMPLES_PER_TASK, Settings().max_batch_episodes)
DEADLINE_MARGIN_SECONDS = 600
MAX_EPISODE_SECONDS = 600.0


def burst_test(seconds: float) -> str:
    """The test an episode is graded by: it sleeps `seconds`, then checks the code."""
    return (
        "import time\n"
        "import unittest\n"
        "\n"
        "from burst import answer\n"
        "\n"
        f"SECONDS = {float(seconds)!r}\n"
        "\n"
        "\n"
        "class BurstTest(unittest.TestCase):\n"
        "    def test_answer_after_the_episode_s_seconds(self):\n"
        "        time.sleep(SECONDS)\n"
        f"        self.assertEqual(answer(), {ANSWER})\n"
    )


def burst_task(task_id: str, seconds: float) -> dict[str, Any]:
    return {
        "id": task_id,
        "description": f"bench_slots burst: the test sleeps {seconds} s, then passes",
        "statement": "burst.py is right as it is. Submit.",
        "files": {"burst.py": f"def answer():\n    return {ANSWER}\n"},
        "test_files": {TEST_FILE: burst_test(seconds)},
        "test_command": ["python", "-B", "-m", "unittest", "-v"],
        "reward": "all",
        "baseline": False,
        # The sleep inside the test's own limit, with room for the interpreter's start.
        "test_timeout_seconds": math.ceil(seconds) + 60,
    }


def split(episodes: int) -> tuple[int, int]:
    """(tasks, samples per task) whose product is `episodes`: the fewest tasks that keep each
    task's samples within MAX_SAMPLES_PER_TASK."""
    if not 1 <= episodes <= MAX_BURST:
        raise ValueError(f"a burst holds 1..{MAX_BURST} episodes, got {episodes}")
    tasks = math.ceil(episodes / MAX_SAMPLES_PER_TASK)
    while episodes % tasks:
        tasks += 1  # ends at `episodes` itself at worst (one sample each, within MAX_TASKS)
    return tasks, episodes // tasks


def burst_tasks(episodes: int, seconds: float) -> tuple[list[dict[str, Any]], int]:
    """The burst's tasks and its samples per task."""
    count, samples = split(episodes)
    return [burst_task(f"{TASK_PREFIX}-{n}", seconds) for n in range(count)], samples


def burst_limits(
    tasks: Sequence[Mapping[str, Any]], episodes: int, parallelism: int, seconds: float
) -> dict[str, int]:
    """The request's episode timeout and deadline for the burst (the module's docstring)."""
    timeout, longest = task_limits(
        list(tasks), episodes, parallelism, episode_timeout=None, deadline=None
    )
    deadline = DEADLINE_MARGIN_SECONDS + math.ceil(3 * episodes * max(seconds, 1.0))
    return {"episode_timeout_seconds": timeout, "deadline_seconds": min(longest, deadline)}


def burst_problems(report: Mapping[str, Any], seconds: float) -> list[str]:
    """What shows a burst's episodes were not graded as built: a reward below 1, a test not
    counted as passed, or grading that took less than the test's sleep."""
    problems = []
    for row in report["pods"]:
        problem = graded_problem(row, 1)
        if problem is not None:
            problems.append(problem)
        tests = row_grading_seconds(row)
        if tests is not None and tests < seconds:
            problems.append(
                f"episode {row.get('index')}: its tests took {tests:.2f} s, under {seconds} s"
            )
    return problems


def graded_problem(row: Mapping[str, Any], tests: int) -> str | None:
    """What is wrong with an episode that should have earned reward 1 by `tests` tests, each
    counted as run and passed by the grader's harness (a count no exit status can fake); None
    when nothing is."""
    passed, total = row.get("tests_passed"), row.get("tests_total")
    if row.get("reward") == 1 and passed == total == tests:
        return None
    return (
        f"episode {row.get('index')}: reward {row.get('reward')}, tests passed {passed} of {total}"
    )


def row_grading_seconds(row: Mapping[str, Any]) -> float | None:
    """An episode's grading seconds, from its cost ledger (None: not recorded)."""
    return ((row.get("cost") or {}).get("wall") or {}).get("tests")


def grading_seconds(report: Mapping[str, Any]) -> float | None:
    """The median of the episodes' grading seconds (their test's sleep and its start)."""
    got = sorted(t for row in report["pods"] if (t := row_grading_seconds(row)) is not None)
    return got[(len(got) - 1) // 2] if got else None


def check_burst_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--burst and --episode-seconds: refused with a clear error, or the defaults filled in."""
    if args.burst is None:
        if args.episode_seconds is not None:
            parser.error("--episode-seconds needs --burst (the default batch runs bundled tasks)")
        return
    if not 1 <= args.burst <= MAX_BURST:
        parser.error(f"--burst must be within 1..{MAX_BURST} episodes, got {args.burst}")
    if args.episode_seconds is None:
        args.episode_seconds = 1.0
    if not 0 < args.episode_seconds <= MAX_EPISODE_SECONDS:  # NaN fails this too
        parser.error(
            f"--episode-seconds must be above 0 and at most {MAX_EPISODE_SECONDS} (each "
            f"episode's test sleeps that long), got {args.episode_seconds}"
        )
    if not 1 <= args.parallelism <= args.burst:
        parser.error(f"--parallelism must be within 1..--burst ({args.burst})")

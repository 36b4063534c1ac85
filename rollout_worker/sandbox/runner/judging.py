"""A test run judged: its counts, what the agent may not leave, the rules `all` and
`fraction`, and the watch on test commands the harness cannot count."""

from __future__ import annotations

import contextlib
import json
import os

from .stream import STREAM_READ

MAX_HARNESS_RECORD = 64 * 1024
# Why a reward is below full (the row's grade_cause); None when the tests earned it all.
CAUSE_FAILED = "tests_failed"
CAUSE_MISSING = "tests_missing"  # fewer tests ran than the task promises, or none
CAUSE_EXITED = "runner_exited"  # the test run ended before it reported its end
CAUSE_TIMED_OUT = "tests_timed_out"
CAUSE_TAMPERED = "tests_tampered"  # the code under test replaced or hooked the test runner
CAUSE_EXIT_STATUS = "exit_status"  # the tests said pass but the command exited non-zero
CAUSE_NO_REWARD_FILE = "no_reward_file"
CAUSE_BAD_REWARD_FILE = "reward_file_invalid"
CAUSE_REWARD_FILE = "reward_file"  # the tests wrote a reward below 1
GRADED_BY_RESULTS = "test_results"
GRADED_BY_EXIT = "exit_status"
GRADED_BY_FILE = "reward_file"


# Files the agent may not leave for the grader unless the task gave them (remove_shadows).
UNASKED_NAMES = (
    "sitecustomize.py",
    "usercustomize.py",
    "conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "tox.ini",
    "setup.cfg",
)
UNASKED_SUFFIXES = (".pth", ".pyc", ".pyo", ".so", ".pyd")


def unasked(name: str) -> bool:
    return name in UNASKED_NAMES or name.endswith(UNASKED_SUFFIXES)


class TestRun:
    """One run of the task's test command: its exit status and output, how it can be graded,
    and (through the harness) every run's counts and whether the end was reported."""

    __test__ = False  # not a pytest class

    def __init__(
        self, code: int, output: str, graded_by: str, runs: list | None = None, ended: bool = False
    ) -> None:
        self.code = code
        self.output = output
        self.graded_by = graded_by
        self.runs = runs or []
        self.ended = ended
        self.unended = 0  # watched Python processes that never reported their end

    def promise(self) -> dict | None:
        """What a later run must reach (the baseline's): the tests it collected and skipped;
        None when this run cannot say."""
        if self.graded_by != GRADED_BY_RESULTS or not self.ended or not self.runs:
            return None
        counts = tally(self.runs)
        return {"collected": counts["collected"], "skipped": counts["skipped"]}


def judge(rule: str, run: TestRun, promise: dict | None) -> dict:
    """The rule `all` or `fraction` over a test run: the reward event's reward, grade_cause,
    tests_passed, tests_total. Counted runs (the harness) earn a reward only for tests that
    really ran: at least one, every one the task promises (the baseline's count), none failed,
    no more skipped than the baseline skipped, and the end of the run reported."""
    cause: str | None
    if run.graded_by != GRADED_BY_RESULTS:
        cause = None if run.code == 0 else CAUSE_TIMED_OUT if run.code == 124 else CAUSE_FAILED
        if run.unended and run.code != 124:
            cause = CAUSE_EXITED
        return {"reward": 1 if cause is None else 0, "grade_cause": cause,
                "tests_passed": None, "tests_total": None}  # fmt: skip
    counts = tally(run.runs)
    expected = (promise or {}).get("collected", 0)
    allowed_skips = (promise or {}).get("skipped", 0)
    total = max(counts["collected"], expected)
    passed = counts["passed"]
    missing = (
        not run.runs
        or counts["collected"] == 0
        or counts["collected"] < expected
        or counts["skipped"] > allowed_skips
        or passed + counts["skipped"] + counts["failed"] < counts["collected"]
    )
    if run.code == 124:
        cause = CAUSE_TIMED_OUT
    elif not run.ended:
        cause = CAUSE_EXITED
    elif tampered(run.runs):
        cause = CAUSE_TAMPERED
    elif counts["failed"]:
        cause = CAUSE_FAILED
    elif missing:
        cause = CAUSE_MISSING
    elif run.code != 0:
        cause = CAUSE_EXIT_STATUS
    else:
        cause = None
    countable = total - min(counts["skipped"], allowed_skips)
    if cause in (CAUSE_TIMED_OUT, CAUSE_EXITED, CAUSE_TAMPERED) or countable <= 0:
        reward: float = 0
    elif rule == "fraction":
        reward = min(passed, countable) / countable
        if cause is not None and reward >= 1:
            reward = (countable - 1) / countable  # never full reward from a flawed run
    else:
        reward = 1 if cause is None else 0
    if cause is None and reward < 1:
        cause = CAUSE_FAILED
    return {"reward": reward, "grade_cause": cause, "tests_passed": passed, "tests_total": total}


def read_records(fd: int, key: str) -> list:
    """The records on a result pipe that carry `key` (closing it): lines without it, or beyond
    MAX_HARNESS_RECORD, are ignored, since the code under test may write to the pipe too."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while len(data) <= MAX_HARNESS_RECORD:
            chunk = os.read(fd, STREAM_READ)
            if not chunk:
                break
            data += chunk
    os.close(fd)
    records = []
    for line in data[:MAX_HARNESS_RECORD].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("key") == key:
            records.append(record)
    return records


def read_harness(fd: int, key: str) -> tuple[list, bool]:
    """(the runs' counts, whether the end was reported) from the harness's pipe."""
    records = read_records(fd, key)
    runs = [r["run"] for r in records if isinstance(r.get("run"), dict)]
    return runs, any(r.get("end") is True for r in records)


# A test command the harness cannot count still runs its Python processes with this watch
# (a sitecustomize module of the grader's, first on PYTHONPATH): each process started by the
# command itself reports its start and, from atexit, its end. One that started and never
# ended left by os._exit or a signal (code under test that exits 0 at import, so that the
# task's script sees a passing check): no reward. The variable is dropped at once, so the
# processes those start are not watched (a test's own server, killed on purpose).
WATCH_ENV = "ROLLOUT_EXIT_WATCH"
WATCH_SOURCE = """import atexit, json, os


def _rollout_watch():
    fd, _, key = os.environ.pop("ROLLOUT_EXIT_WATCH", "").partition(":")
    try:
        fd = int(fd)
        os.write(fd, (json.dumps({"key": key, "start": os.getpid()}) + "\\n").encode())
    except (ValueError, OSError):
        return

    def end():
        try:
            os.write(fd, (json.dumps({"key": key, "end": os.getpid()}) + "\\n").encode())
        except OSError:
            pass

    atexit.register(end)


_rollout_watch()
del _rollout_watch
"""


def unended(records: list, killed: set | frozenset = frozenset()) -> int:
    """How many watched processes started and never reported their end, besides those
    `killed` by the grader because they were still running when the test command ended (a
    server the task's script started in the background)."""
    started = {r["start"] for r in records if isinstance(r.get("start"), int)}
    ended = {r["end"] for r in records if isinstance(r.get("end"), int)}
    return len(started - ended - killed)


def _tally_count(run: dict, name: str) -> int:
    value = run.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def tally(runs: list) -> dict:
    """The counts of every run of one test command, summed."""
    return {
        n: sum(_tally_count(r, n) for r in runs)
        for n in ("collected", "passed", "failed", "skipped")
    }


def tampered(runs: list) -> list:
    """What the code under test replaced of the test machinery, over every run."""
    return sorted(
        {str(n) for r in runs if isinstance(r.get("tampered"), list) for n in r["tampered"]}
    )

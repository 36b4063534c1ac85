"""The grader: the task's tests placed and run over the workspace, the reward rule applied."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile

from .artifacts import collect_artifacts
from .errors import EpisodeError, InfrastructureError
from .events import truncate
from .harness import HARNESS_KEY_BYTES, harness_plan
from .harness_program import take_shipped_harness, write_harness
from .judging import (
    CAUSE_EXITED,
    CAUSE_REWARD_FILE,
    CAUSE_TAMPERED,
    CAUSE_TIMED_OUT,
    GRADED_BY_EXIT,
    GRADED_BY_FILE,
    GRADED_BY_RESULTS,
    WATCH_ENV,
    WATCH_SOURCE,
    TestRun,
    judge,
    read_harness,
    read_records,
    tampered,
    unasked,
    unended,
)
from .processes import kill_leftovers, resolve_argv, run_process
from .rewards import MAX_REWARD_FILE_BYTES, RewardFileProblem, read_reward
from .taskenv import resolve_task_env, take_host_values
from .workspace import fresh_dir, write_files

TESTS_TIMEOUT_SECONDS = 60
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
VERIFIER_DIR = "/logs/verifier"


class Grader:
    """The tests of a task over a workspace, and the reward rule applied to their run."""

    def __init__(self, task: dict, root: str) -> None:
        self.task = task
        self.root = root
        # The test command's own limit (Harbor's [verifier] timeout_sec), not the agent's.
        self.test_timeout = float(task.get("test_timeout_seconds", TESTS_TIMEOUT_SECONDS))
        self.tests_dir = TESTS_DIR
        self.promise: dict | None = None  # the baseline's counts, when it ran and counted
        # Where /tests, /solution and /logs/verifier are made: those paths, unless the runner's
        # environment names others (a sandbox without a root of its own; tests).
        self.places = {
            name: os.environ.get(name) or default
            for name, default in (
                ("ROLLOUT_TESTS_DIR", TESTS_DIR),
                ("ROLLOUT_SOLUTION_DIR", SOLUTION_DIR),
                ("ROLLOUT_VERIFIER_DIR", VERIFIER_DIR),
            )
        }
        shim = tempfile.mkdtemp(prefix="rollout-bin-")
        for name in ("python", "python3"):
            os.symlink(sys.executable, os.path.join(shim, name))
        self.env = {
            "PATH": f"{shim}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": root,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        # The task's env tables, resolved here (a missing ${VAR} is refused by need_task_env
        # before anything runs); the tests see [environment.env] then [verifier.env], as in
        # Harbor, whose verifier runs in the environment's container with its own env added.
        self.task_env, self.task_env_missing = resolve_task_env(task, take_host_values())
        self.test_env = {
            **self.task_env.get("environment", {}),
            **self.task_env.get("verifier", {}),
        }
        if harness_plan(list(task.get("test_command") or [])) is not None:
            take_shipped_harness()  # now: before any agent runs

    def need_task_env(self) -> None:
        """Refuse an episode whose task's ${VAR} had no value where its sandbox started (the
        backends' preflights refuse such a batch first): the task would run without it. Not
        the agent's doing: never a reward-0 sample."""
        if self.task_env_missing:
            raise InfrastructureError(
                f"task {self.task.get('id')!r}: no value for "
                f"{', '.join(self.task_env_missing)} where the sandbox started"
            )

    def test_argv(self) -> list:
        """The task's test command, naming the directory that stands in for /tests (when the
        tests are elsewhere)."""
        argv = list(self.task["test_command"])
        if self.tests_dir == TESTS_DIR:
            return argv
        return [
            self.tests_dir + a[len(TESTS_DIR) :]
            if a == TESTS_DIR or a.startswith(TESTS_DIR + "/")
            else a
            for a in argv
        ]

    def remove_shadows(self) -> list:
        """What the agent added that would run in the grader unasked, removed before the final
        tests (the task's own files of the same names stay): modules named like the standard
        library's at the top of the repository (a `unittest.py` wins over the real one);
        anywhere, interpreter start-up hooks (`sitecustomize`, `usercustomize`, `*.pth`),
        pytest's configuration and hooks (`conftest.py`, `pytest.ini`, `tox.ini`, `setup.cfg`)
        and compiled modules (`__pycache__`, `*.pyc`, `*.so`: they load before or instead of
        the source)."""
        names = set(getattr(sys, "stdlib_module_names", ())) | {"sitecustomize", "usercustomize"}
        given = set(self.task.get("files") or {}) | set(self.task.get("test_files") or {})
        tops = {path.split("/")[0] for path in given}
        removed = []
        for entry in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, entry)
            package = os.path.isdir(path) and not os.path.islink(path)
            stem = entry[:-3] if entry.endswith(".py") else entry
            if stem not in names or entry in tops or not (package or entry.endswith(".py")):
                continue
            if package:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(entry)
        for folder, dirs, files in os.walk(self.root):
            relative = os.path.relpath(folder, self.root)
            for name in list(dirs):
                if name == "__pycache__":
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
                    dirs.remove(name)
                    removed.append(os.path.normpath(os.path.join(relative, name)))
            for name in files:
                path = os.path.normpath(os.path.join(relative, name))
                if path in given or not unasked(name):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
                    removed.append(path)
        return removed

    def run_tests(self, extra_env: dict | None = None) -> TestRun:
        try:
            write_files(self.root, self.task.get("test_files") or {})
        except (OSError, ValueError) as exc:
            raise EpisodeError(f"the task's test_files cannot be written: {exc}") from None
        shutil.rmtree(os.path.join(self.root, "__pycache__"), ignore_errors=True)
        env = {**self.env, **self.test_env, **(extra_env or {})}
        argv = self.test_argv()
        plan = harness_plan(argv)
        key = os.urandom(HARNESS_KEY_BYTES).hex()
        results_read, results_write = os.pipe()
        if plan is None or (plan[1] not in ("unittest", "pytest") and not self.counts(plan[1])):
            folder = tempfile.mkdtemp(prefix="rollout-watch-")
            with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as out:
                out.write(WATCH_SOURCE)
            env["PYTHONPATH"] = ":".join(filter(None, (folder, env.get("PYTHONPATH"))))
            env[WATCH_ENV] = f"{results_write}:{key}"
            try:
                code, output, killed = run_process(
                    resolve_argv(argv, env["PATH"]),
                    env,
                    self.root,
                    self.test_timeout,
                    (results_write,),
                )
            finally:
                os.close(results_write)
                shutil.rmtree(folder, ignore_errors=True)
            run = TestRun(code, output, GRADED_BY_EXIT)
            run.unended = unended(read_records(results_read, key), killed)
            return run
        flags, what, args = plan
        key_read, key_write = os.pipe()
        os.write(key_write, key.encode())
        os.close(key_write)
        # Written anew for every run, after the agent is gone: nothing it left can be the
        # harness (its bytecode is compiled once a process, by this one). -E and -s: no PYTHON*
        # variable and no user site folder (under $HOME, the workspace) reaches the interpreter
        # that runs the tests.
        folder = tempfile.mkdtemp(prefix="rollout-harness-")
        command = [sys.executable, "-E", "-s", *flags, write_harness(folder, flags)]
        command += [str(results_write), str(key_read), what, *args]
        try:
            code, output, _ = run_process(
                command, env, self.root, self.test_timeout, (results_write, key_read)
            )
        finally:
            os.close(results_write)
            os.close(key_read)
            shutil.rmtree(folder, ignore_errors=True)
        runs, ended = read_harness(results_read, key)
        return TestRun(code, output, GRADED_BY_RESULTS, runs, ended)

    def counts(self, script: str) -> bool:
        """Whether a test script is one the harness can count: it runs unittest (a script of
        plain asserts keeps its exit status)."""
        try:
            with open(os.path.join(self.root, script), "rb") as handle:
                return b"unittest" in handle.read(MAX_REWARD_FILE_BYTES)
        except OSError:
            return False

    def grade(self) -> dict:
        """Place the tests, run them, apply the reward rule: the reward event's fields."""
        # Nothing the agent started may still run (a daemon rewriting files): the built-in
        # loop's commands and an agent command's leftovers are gone before the tests start.
        kill_leftovers()
        env = {"ROLLOUT_WORKSPACE": self.root}
        tests = self.task.get("tests") or {}
        if tests:
            self.tests_dir = fresh_dir(self.places["ROLLOUT_TESTS_DIR"], "rollout-tests-")
            try:
                write_files(self.tests_dir, tests, scripts=True)
            except (OSError, ValueError) as exc:
                raise EpisodeError(f"the task's tests cannot be written: {exc}") from None
            env["ROLLOUT_TESTS_DIR"] = self.tests_dir
        rule = self.task.get("reward", "all")
        verifier = None
        if rule == "file" or tests:
            # Only then: a task of files and test_files alone leaves the machine's / untouched
            # (its runner may run outside a sandbox, in tests or without isolation).
            verifier = fresh_dir(self.places["ROLLOUT_VERIFIER_DIR"], "rollout-verifier-")
            env["ROLLOUT_VERIFIER_DIR"] = verifier
        removed = self.remove_shadows()
        run = self.run_tests(env)
        details = None
        if rule == "file" and verifier is not None:
            verdict = judge("all", run, self.promise)
            verdict["reward"], verdict["grade_cause"] = 0, None
            try:
                if run.code < 0 or run.code == 124 or run.unended:
                    # Killed by a signal (code under test that kills the script before it
                    # writes its verdict, after planting one), a Python process of the tests
                    # that never ended (exit 0 at import) or cut at the time limit: what the
                    # reward file holds is no verdict of the tests.
                    cause = CAUSE_TIMED_OUT if run.code == 124 else CAUSE_EXITED
                    raise RewardFileProblem(f"the tests ended with status {run.code}", cause)
                reward, details = read_reward(verifier)
                verdict["reward"] = reward
                if reward < 1:
                    verdict["grade_cause"] = CAUSE_REWARD_FILE
            except RewardFileProblem as problem:
                verdict["grade_cause"] = problem.cause
                run.output += f"\n[{problem}]"
            graded_by = GRADED_BY_FILE
        else:
            verdict = judge(rule, run, self.promise)
            graded_by = run.graded_by
            if verdict["grade_cause"] == CAUSE_TAMPERED:
                run.output += f"\n[the code under test replaced {', '.join(tampered(run.runs))}]"
        shown, _ = truncate(run.output)
        # Harbor's artifacts, after the tests as Harbor collects them: into the reward event,
        # so into the episode's log (a record of the batch).
        listed = self.task.get("artifacts")
        collected = collect_artifacts(listed, self.root) if listed else {}
        return {
            **collected,
            **verdict,
            "reward_rule": rule,
            "reward_details": details,
            "graded_by": graded_by,
            "tests_exit": run.code,
            "tests_output": shown,
            "tests_promised": (self.promise or {}).get("collected"),
            "removed_before_tests": removed,
        }

"""The test harness: which test commands can be counted, and the part of the program that
runs them and reports what ran on a pipe only the runner reads."""

from __future__ import annotations

import os
import sys
import typing

from .comparisons import watch_comparisons
from .vault import lock_up, tell

# -- the test harness: what ran, told where the code under test cannot print -------------------
# Test commands the grader can count: `python [flags] -m unittest|pytest ...` and
# `python [flags] script.py ...` (a script that calls unittest.main()). They run through the
# harness (its part of this file, run alone: `harness_source`), which reports what ran on a
# pipe only the runner reads, each record carrying a key the runner handed over on another
# pipe (read and closed before any test code is imported). Anything else (a task's own shell
# script) is graded by its exit status or its reward file, and the row says so (`graded_by`).
# Interpreter options a test command may carry; the harness passes them on.
PYTHON_FLAGS = {"-B", "-b", "-bb", "-u", "-O", "-OO", "-q", "-s", "-E"}
PYTHON_OPTIONS = {"-W", "-X"}  # each followed by a value


def harness_plan(argv: list) -> tuple[list, str, list] | None:
    """(interpreter flags, what runs: "unittest" | "pytest" | a script path, its arguments) of
    a countable test command; None for any other."""
    if not argv or argv[0] not in ("python", "python3"):
        return None
    flags: list = []
    rest = list(argv[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        flag = rest.pop(0)
        if flag in PYTHON_OPTIONS and rest:
            flags += [flag, rest.pop(0)]
        elif flag in PYTHON_FLAGS:
            flags.append(flag)
        else:
            return None
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in ("unittest", "pytest"):
        return flags, rest[1], rest[2:]
    if rest and rest[0].endswith(".py"):
        return flags, rest[0], rest[1:]
    return None


# -- harness: begin. The harness (os and sys its only imports; typing only in annotations),
# run alone so a test run starts about as fast as the bare command: `harness_source`.
HARNESS_KEY_BYTES = 16


def _fingerprint(classes: list) -> list:
    """Each class's own attributes: their names, in order, and their values (held, compared by
    identity; not by id(), an audit event the vault would hear for every attribute)."""
    found = []
    for c in classes:
        items = list(vars(c).items())
        found.append(([name for name, _ in items], [value for _, value in items]))
    return found


def _same(values: list, others: list) -> bool:
    return len(values) == len(others) and all(a is b for a, b in zip(values, others))  # noqa: B905


def _resolved(classes: list, modules: list) -> dict:
    """What each attribute of `classes` resolves to (through the class's MRO: an override added
    to a subclass counts), and each callable of `modules` (the objects, compared by identity)."""
    found = {
        f"{c.__module__}.{c.__qualname__}.{name}": value
        for c in classes
        for k in reversed(c.__mro__[:-1])
        for name, value in list(vars(k).items())
    }
    for module in modules:
        for name, value in list(vars(module).items()):
            if callable(value):
                found[f"{module.__name__}.{name}"] = value
    return found


def _replaced(classes: list, modules: list, before: dict) -> list:
    """Of what `before` held, what no longer resolves to the same object (sorted). Names
    added since are not counted: pytest imports and sets some of its own as it runs."""
    now, absent = _resolved(classes, modules), object()
    return sorted(name for name, value in before.items() if now.get(name, absent) is not value)


def _tampering(classes: list, before: list) -> list:
    """The attributes of `classes` replaced, added or removed since `before` (sorted)."""
    found, absent = [], object()
    # zip without strict=: Python 3.9 runs this (a task's own image).
    for c, then, now in zip(classes, before, _fingerprint(classes)):  # noqa: B905
        if then[0] == now[0] and _same(then[1], now[1]):  # the names are str: no method runs
            continue
        old, new = dict(zip(*then)), dict(zip(*now))  # noqa: B905
        found += [
            f"{c.__module__}.{c.__qualname__}.{name}"
            for name in old.keys() | new.keys()
            if old.get(name, absent) is not new.get(name, absent)
        ]
    return sorted(found)


def _unittest_machinery() -> list:
    """unittest's classes that decide a test's verdict: what the code under test must leave
    as it found them."""
    import unittest
    import unittest.case

    return [
        unittest.TestCase,
        unittest.case._Outcome,  # type: ignore[attr-defined]
        unittest.TestResult,
        unittest.TextTestResult,
        unittest.TextTestRunner,
        unittest.TestSuite,
        unittest.suite.BaseTestSuite,
        unittest.TestLoader,
        unittest.TestProgram,
    ]


def _unittest_recorder(report: typing.Callable[[dict], None], claims: set) -> type:
    """A TextTestRunner that reports each test's verdict (by test id) when its run ends, and
    which of unittest's own machinery the code under test replaced (an assertion made a no-op,
    TestCase.run or the result's methods rewritten so every test "passes"): checked after
    every test and at the end, against what it was before any test module was imported; and
    the operands equal to anything (`claims`, filled by watch_comparisons)."""
    import unittest

    class Result(unittest.TextTestResult):
        def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
            super().__init__(*args, **kwargs)
            self.verdicts: dict = {}
            self.tampered: set = set()

        def _mark(self, test: typing.Any, verdict: str) -> None:
            self.tampered.update(_tampering(watched, before), claims)
            key = test.id()
            if self.verdicts.get(key) != "failed":  # a failed subtest fails its test for good
                self.verdicts[key] = verdict

        def addSuccess(self, test: typing.Any) -> None:
            super().addSuccess(test)
            self._mark(test, "passed")

        def addExpectedFailure(self, test: typing.Any, err: typing.Any) -> None:
            super().addExpectedFailure(test, err)
            self._mark(test, "passed")

        def addFailure(self, test: typing.Any, err: typing.Any) -> None:
            super().addFailure(test, err)
            self._mark(test, "failed")

        def addError(self, test: typing.Any, err: typing.Any) -> None:
            super().addError(test, err)
            self._mark(test, "failed")

        def addUnexpectedSuccess(self, test: typing.Any) -> None:
            super().addUnexpectedSuccess(test)
            self._mark(test, "failed")

        def addSkip(self, test: typing.Any, reason: str) -> None:
            super().addSkip(test, reason)
            self._mark(test, "skipped")

        def addSubTest(self, test: typing.Any, subtest: typing.Any, err: typing.Any) -> None:
            super().addSubTest(test, subtest, err)
            if err is not None:
                self.verdicts[test.id()] = "failed"

    class Runner(unittest.TextTestRunner):
        resultclass = Result

        def run(self, test: typing.Any) -> typing.Any:
            collected = test.countTestCases()
            result = super().run(test)
            verdicts = list(result.verdicts.values())  # type: ignore[attr-defined]
            tampered = result.tampered | set(_tampering(watched, before)) | claims  # type: ignore[attr-defined]
            report(
                {
                    "collected": collected,
                    "passed": verdicts.count("passed"),
                    "failed": verdicts.count("failed"),
                    "skipped": verdicts.count("skipped"),
                    "tampered": sorted(tampered)[:20],
                }
            )
            return result

    watched = [*_unittest_machinery(), Result, Runner]
    before = _fingerprint(watched)
    return Runner


# The hooks through which a plugin decides what a test's verdict is, or what is counted.
VERDICT_HOOKS = (
    "pytest_collection_modifyitems",
    "pytest_collection_finish",
    "pytest_runtest_protocol",
    "pytest_runtest_setup",
    "pytest_runtest_call",
    "pytest_pyfunc_call",
    "pytest_runtest_teardown",
    "pytest_runtest_makereport",
    "pytest_runtest_logreport",
    "pytest_report_teststatus",
    "pytest_sessionfinish",
)


def _pytest_machinery() -> tuple:
    """(classes, modules) of pytest and pluggy that decide a verdict: what the code under test
    must leave as it found them (unittest's too: pytest runs TestCase classes through them)."""
    import _pytest.assertion.rewrite
    import _pytest.main
    import _pytest.nodes
    import _pytest.outcomes
    import _pytest.python
    import _pytest.reports
    import _pytest.runner
    import _pytest.skipping
    import _pytest.unittest

    modules = [
        _pytest.assertion.rewrite,
        _pytest.main,
        _pytest.nodes,
        _pytest.outcomes,
        _pytest.python,
        _pytest.reports,
        _pytest.runner,
        _pytest.skipping,
        _pytest.unittest,
        *(m for name, m in sorted(sys.modules.items()) if name.split(".")[0] == "pluggy"),
    ]
    classes = [
        value
        for module in modules
        for value in list(vars(module).values())
        if isinstance(value, type) and value.__module__ == module.__name__
    ]
    return classes + _unittest_machinery(), modules


def _foreign_hooks(config: typing.Any, own: object, allowed: set) -> list:
    """Verdict hooks implemented by code of the workspace (the working directory): a plugin
    the code under test registered, or planted through configuration. Only the conftest.py
    files there before the run (the task's: the agent's are removed) may implement them."""
    workspace = os.path.realpath(os.getcwd()) + os.sep
    found = set()
    for hook in VERDICT_HOOKS:
        for impl in getattr(config.hook, hook).get_hookimpls():
            plugin = impl.plugin
            if plugin is own:
                continue
            where = getattr(plugin, "__file__", None)
            if where is None:
                module = sys.modules.get(getattr(type(plugin), "__module__", ""))
                where = getattr(module, "__file__", None)
            path = os.path.realpath(where) if isinstance(where, str) else ""
            if path.startswith(workspace) and path not in allowed:
                found.add(f"{hook} by {os.path.relpath(path, workspace)}")
    return sorted(found)


def _conftests_now() -> set:
    """The conftest.py files in the workspace as the run starts (real paths)."""
    found = set()
    for folder, dirs, files in os.walk(os.getcwd()):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        if "conftest.py" in files:
            found.add(os.path.realpath(os.path.join(folder, "conftest.py")))
    return found


def _pytest_recorder(report: typing.Callable[[dict], None], claims: set) -> object:
    """A pytest plugin object: what was collected, each test's verdict (by node id), and what
    the code under test replaced of pytest's and pluggy's machinery or hooked into it: checked
    after every test and at the end, against what it was before any test module was
    imported; and the operands equal to anything (`claims`, filled by watch_comparisons)."""
    classes, modules = _pytest_machinery()
    before = _resolved(classes, modules)
    allowed = _conftests_now()

    class Recorder:
        def __init__(self) -> None:
            self.collected = 0
            self.verdicts: dict = {}
            self.tampered: set = set()

        def _look(self, config: typing.Any) -> None:
            self.tampered.update(_replaced(classes, modules, before), claims)
            self.tampered.update(_foreign_hooks(config, self, allowed))

        def pytest_collection_finish(self, session: typing.Any) -> None:
            self.collected = len(session.items)
            self._look(session.config)

        def pytest_runtest_logreport(self, report: typing.Any) -> None:
            if report.when == "call":
                self._look(self.config)
            key = report.nodeid
            if report.failed:
                self.verdicts[key] = "failed"
            elif report.skipped and self.verdicts.get(key) != "failed":
                self.verdicts[key] = "skipped"
            elif report.when == "call" and key not in self.verdicts:
                self.verdicts[key] = "passed"

        def pytest_configure(self, config: typing.Any) -> None:
            self.config = config

        def pytest_assertion_pass(
            self, item: typing.Any, lineno: int, orig: str, expl: str
        ) -> None:
            """Implemented so that a passing assertion shows its operands (to
            watch_comparisons); its text is not needed."""

        def pytest_sessionfinish(self, session: typing.Any) -> None:
            self._look(session.config)
            verdicts = list(self.verdicts.values())
            report(
                {
                    "collected": self.collected,
                    "passed": verdicts.count("passed"),
                    "failed": verdicts.count("failed"),
                    "skipped": verdicts.count("skipped"),
                    "tampered": sorted(self.tampered)[:20],
                }
            )

    return Recorder()


def harness(argv: list) -> int:
    """`harness.py RESULT_FD KEY_FD WHAT ARGS...`: run the tests, reporting every
    run's counts and then the end on RESULT_FD, each line carrying the key read from KEY_FD
    (which only the vault keeps)."""
    result_fd, key_fd, what, args = int(argv[0]), int(argv[1]), argv[2], argv[3:]
    # The real ones, before the workspace is on the path; and before the vault, which then
    # does not look at their imports (no code under test has run yet).
    import unittest

    if what == "pytest":
        import _pytest.assertion.rewrite  # noqa: F401  (the real one: its comparisons are watched)
    with os.fdopen(key_fd, "rb") as handle:
        script = "" if what in ("unittest", "pytest") else what
        lock_up(handle.read(HARNESS_KEY_BYTES * 2).decode(), result_fd, script)

    def report(counts: dict) -> None:
        tell("run", counts)

    claims: set = set()
    watch_comparisons(claims)
    runner = _unittest_recorder(report, claims)
    # As `python -m` or `python script.py` would: the working directory (or the script's
    # directory) first on the path, never this program's own.
    sys.path[0] = os.getcwd() if what in ("unittest", "pytest") else os.path.dirname(what)
    code: object = 0
    try:
        if what == "unittest":
            sys.argv = ["python -m unittest", *args]
            program = unittest.main(module=None, argv=sys.argv, testRunner=runner, exit=False)
            code = 0 if program.result.wasSuccessful() else 1
        elif what == "pytest":
            sys.argv = ["pytest", *args]
            import pytest

            # Rewritten assertions that show their operands when they pass, whatever a
            # configuration file the agent may have written says (the command line wins).
            watched = ["--assert=rewrite", "-o", "enable_assertion_pass_hook=true", *args]
            code = int(pytest.main(watched, plugins=[_pytest_recorder(report, claims)]))
        else:
            import runpy

            # What unittest.main() runs by default.
            unittest.runner.TextTestRunner = runner  # type: ignore[misc,assignment]
            sys.argv = [what, *args]
            runpy.run_path(what, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    tell("end")
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


# -- harness: end

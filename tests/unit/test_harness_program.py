"""The harness as the grader runs it: its bytecode compiled by the local backend beside the
program (taken only when it is this interpreter's and this program's), or else once a process
(never by a test interpreter), written anew with each run, naming that run's folder as its file
(the vault trusts the harness's frames by their file), and honest runs recorded whole from
it."""

from __future__ import annotations

import importlib.util
import marshal
import os
import subprocess
import sys
import types

from rollout_worker.backends.local.sandbox import HARNESS_MOUNT, plan_sandbox
from rollout_worker.sandbox import compile_program, compiled_path, episode_program_text
from tests.runner_program import episode

TESTS = """import unittest

from shipping import shipping


class ShippingTest(unittest.TestCase):
    def test_below(self):
        self.assertEqual(shipping(98), 10)

    def test_threshold(self):
        self.assertEqual(shipping(99), 0)
"""
FIXED = "def shipping(total):\n    return 0 if total >= 99 else 10\n"


def code_objects(code: types.CodeType) -> list:
    inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [code, *(found for c in inner for found in code_objects(c))]


def run(program: str, workspace, *flags: str) -> tuple[list, bool, str]:
    key = os.urandom(episode.HARNESS_KEY_BYTES).hex()
    results_read, results_write = os.pipe()
    key_read, key_write = os.pipe()
    os.write(key_write, key.encode())
    os.close(key_write)
    argv = [sys.executable, "-E", "-s", *flags, program, str(results_write), str(key_read)]
    done = subprocess.run(
        [*argv, "unittest"],
        cwd=workspace,
        pass_fds=(results_write, key_read),
        capture_output=True,
        text=True,
        timeout=60,
    )
    os.close(results_write)
    os.close(key_read)
    runs, ended = episode.read_harness(results_read, key)
    return runs, ended, done.stdout + done.stderr


def test_the_harness_is_compiled_once_and_runs_as_bytecode_from_each_runs_folder(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "test_shipping.py").write_text(TESTS)
    (workspace / "shipping.py").write_text(FIXED)
    episode._harness_code.cache_clear()
    for number in range(2):
        folder = tmp_path / f"harness-{number}"
        folder.mkdir()
        program = episode.write_harness(str(folder), ["-B"])
        assert program == str(folder / "harness.pyc")
        with open(program, "rb") as handle:
            data = handle.read()
        assert data[:4] == importlib.util.MAGIC_NUMBER
        # Every function of the harness names this run's folder: the vault trusts its frames.
        names = {c.co_filename for c in code_objects(marshal.loads(data[16:]))}
        assert names == {str(folder / "harness.py")}
        assert (folder / "harness.py").read_text() == episode.harness_source()
        runs, ended, output = run(program, workspace, "-B")
        assert ended, output
        assert [(r["collected"], r["passed"], r["tampered"]) for r in runs] == [(2, 2, [])]
    assert episode._harness_code.cache_info().misses == 1  # compiled once, not once a run


def test_optimized_test_commands_get_the_harness_compiled_as_they_would_compile_it(tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "test_shipping.py").write_text(TESTS)
    (workspace / "shipping.py").write_text(FIXED)
    folder = tmp_path / "harness"
    folder.mkdir()
    program = episode.write_harness(str(folder), ["-O", "-O"])
    with open(program, "rb") as handle:
        code = marshal.loads(handle.read()[16:])
    docstrings = [c.co_consts[0] for c in code_objects(code) if c.co_name == "harness"]
    assert docstrings == [None]  # -OO: no docstring, as the interpreter would compile it
    runs, ended, output = run(program, workspace, "-OO")
    assert ended, output
    assert [(r["collected"], r["passed"]) for r in runs] == [(2, 2)]


def test_a_replaced_assertion_is_named_once_each_test_is_fingerprinted_by_identity():
    import unittest

    class Case(unittest.TestCase):
        def test_x(self):
            pass

    watched = [Case]
    before = episode._fingerprint(watched)
    assert episode._tampering(watched, before) == []
    Case.assertTrue = lambda self, x, msg=None: None  # type: ignore[method-assign]
    Case.test_x = Case.test_x  # the same object again: not a change
    assert episode._tampering(watched, before) == [f"{__name__}.{Case.__qualname__}.assertTrue"]


def test_the_backends_bytecode_of_this_programs_harness_is_taken_and_no_other(tmp_path):
    program = tmp_path / "program" / "episode.py"
    program.parent.mkdir()
    program.write_text(episode_program_text(), encoding="utf-8")
    assert compile_program(program, sys.executable)
    shipped = program.with_name("harness.pyc")
    plan = plan_sandbox(
        isolation="bwrap",
        python=sys.executable,
        python_prefix="/usr",
        program=program,
        workspace=tmp_path,
        episode_id="e-1",
        action="fix",
        running_as_root=False,
    )
    assert plan.argv[plan.argv.index(HARNESS_MOUNT) - 1] == str(shipped)  # read-only, beside
    # The compiled program takes it from beside itself (as in a sandbox: /sandbox/*.pyc).
    probe = (
        "import runpy, sys; sys.argv = [sys.argv[1]];"
        "space = runpy.run_path(sys.argv[0], run_name='probe');"
        "print(space['take_shipped_harness'](), space['_harness_code'].cache_info().misses)"
    )
    done = subprocess.run(
        [sys.executable, "-B", "-c", probe, str(compiled_path(program))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "True 0\n"
    data = shipped.read_bytes()
    episode._harness_code.cache_clear()
    try:
        assert episode.take_shipped_harness(str(shipped.parent))
        assert episode._harness_code(0) is episode.SHIPPED_HARNESS["code"]  # not compiled
        assert episode._harness_code(1) is not episode.SHIPPED_HARNESS["code"]  # -O: compiled
        for other in (b"\0\0\r\n" + data[4:], data[:8] + bytes(8) + data[16:], data[:20]):
            # Another interpreter's, another program's harness, cut short: compiled here.
            episode.SHIPPED_HARNESS.clear()
            shipped.write_bytes(other)
            assert not episode.take_shipped_harness(str(shipped.parent))
            assert "code" not in episode.SHIPPED_HARNESS
    finally:
        episode.SHIPPED_HARNESS.clear()
        episode._harness_code.cache_clear()


def test_a_program_without_a_harness_leaves_no_harness_bytecode(tmp_path):
    program = tmp_path / "episode.py"
    (tmp_path / "harness.pyc").write_bytes(b"stale")  # another program's
    program.write_text("print('an older program')\n")
    assert compile_program(program, sys.executable)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["episode.py", "episode.pyc"]


def test_the_bytecode_header_is_importlibs_without_importing_it(tmp_path):
    magic, source_hash = episode.pyc_magic()
    assert magic == importlib.util.MAGIC_NUMBER
    for data in (b"", b"print(1)\n", episode.harness_source().encode()):
        assert source_hash(data) == importlib.util.source_hash(data)
    # The compiled program, as a sandbox starts it, takes the backend's harness and writes a
    # run's with importlib.util never imported (-S: no site, whose .pth files may import it).
    program = tmp_path / "episode.py"
    program.write_text(episode_program_text(), encoding="utf-8")
    assert compile_program(program, sys.executable)
    probe = (
        "import marshal, sys; data = open(sys.argv[1], 'rb').read();"
        "space = {'__name__': 'probe', '__file__': sys.argv[1]};"
        "exec(marshal.loads(data[16:]), space);"
        "print(space['take_shipped_harness'](), bool(space['write_harness'](sys.argv[2], [])),"
        " 'importlib.util' in sys.modules)"
    )
    (tmp_path / "run").mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-B",
            "-c",
            probe,
            str(compiled_path(program)),
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "True True False\n"

"""The episode program runs as bytecode its sandbox interpreter compiled once per run, and as
written whenever its source is newer (a program replaced by hand) or the interpreter is a task
image's own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rollout_worker.backends.local.sandbox import COMPILED_MOUNT, ImageRoot, plan_sandbox
from rollout_worker.sandbox import (
    PROGRAM_MOUNT,
    compile_program,
    compiled_path,
    episode_program_text,
)

PYTHON = "/usr/bin/python3"


def plan(program: Path, **changes: object) -> list[str]:
    options: dict = {
        "isolation": "bwrap",
        "python": PYTHON,
        "python_prefix": "/usr",
        "program": program,
        "workspace": program.parent / "ws",
        "episode_id": "e-1",
        "action": "fix",
        "running_as_root": False,
    } | changes
    return plan_sandbox(**options).argv


def written(tmp_path: Path, text: str) -> Path:
    program = tmp_path / "episode.py"
    program.write_text(text)
    return program


def test_a_compiled_program_is_mounted_and_run_instead_of_its_source(tmp_path):
    program = written(tmp_path, episode_program_text())
    assert plan(program)[-1] == PROGRAM_MOUNT  # nothing compiled yet
    assert compile_program(program, PYTHON)
    argv = plan(program)
    assert argv[-1] == COMPILED_MOUNT
    assert argv[argv.index(COMPILED_MOUNT) - 1] == str(compiled_path(program))
    # The source stays mounted: the runner writes its harness from it.
    assert argv[argv.index(PROGRAM_MOUNT) - 1] == str(program)
    # A task image's interpreter may read another bytecode format: it runs the source.
    assert plan(program, root=ImageRoot(tmp_path / "rootfs", "/app"))[-1] == PROGRAM_MOUNT


def test_a_source_written_after_its_bytecode_runs_as_written(tmp_path):
    program = written(tmp_path, "print('old')\n")
    assert compile_program(program, PYTHON)
    later = compiled_path(program).stat().st_mtime_ns + 1
    program.write_text("print('new')\n")
    os.utime(program, ns=(later, later))
    assert plan(program)[-1] == PROGRAM_MOUNT
    none = plan_sandbox(
        isolation="none",
        python=PYTHON,
        python_prefix="/usr",
        program=program,
        workspace=tmp_path,
        episode_id="e-1",
        action="fix",
        running_as_root=False,
    )
    assert subprocess.run(none.argv, capture_output=True, text=True).stdout == "new\n"


def test_the_compiled_runner_writes_its_harness_from_the_source_beside_it(tmp_path):
    program = written(tmp_path, episode_program_text())
    assert compile_program(program, PYTHON)
    probe = (
        "import runpy, sys; sys.argv = [sys.argv[1]];"
        "space = runpy.run_path(sys.argv[0], run_name='probe');"
        "print(space['harness_source']().count('def harness('))"
    )
    done = subprocess.run(
        [PYTHON, "-B", "-c", probe, str(compiled_path(program))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "1\n"


def test_an_interpreter_that_cannot_compile_leaves_no_bytecode(tmp_path):
    program = written(tmp_path, "print(\n")  # a syntax error
    assert not compile_program(program, PYTHON)
    assert not compiled_path(program).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["episode.py"]

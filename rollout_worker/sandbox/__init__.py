"""The program that runs inside a sandbox: written as the `runner` package, shipped as the
one file `program.build_program` makes of it, run by every backend."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rollout_worker.sandbox.program import build_program

# What a compiled program names as its file in tracebacks: where sandboxes mount the source.
PROGRAM_MOUNT = "/sandbox/episode.py"

_COMPILE = (
    "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], dfile=sys.argv[3],"
    " doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)"
)


def episode_program_text() -> str:
    """The program every sandbox runs: the runner package built into one file (built once a
    process; warm-pool keys and ConfigMaps are made of these bytes)."""
    return build_program()


def compiled_path(source: Path) -> Path:
    return source.with_suffix(".pyc")


def compile_program(source: Path, python: str) -> bool:
    """Write `source`'s bytecode beside it, compiled by the interpreter that will run it (the
    format is that interpreter's own). A script is otherwise compiled anew at every start:
    about 17 ms of CPU of a short episode's 0.2 s. False when it cannot be compiled: the
    sandboxes then run the source, which is only slower."""
    target = compiled_path(source)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        subprocess.run(
            [python, "-I", "-c", _COMPILE, str(source), str(tmp), PROGRAM_MOUNT],
            capture_output=True,
            timeout=60,
            check=True,
        )
        tmp.chmod(0o644)
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError):
        tmp.unlink(missing_ok=True)
        return False
    return True

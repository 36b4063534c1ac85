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
# The test harness's bytecode (runner/harness_program.py), compiled from the program's own
# harness by the interpreter that runs it: the runner takes it when its magic and its source's
# hash match its own, and compiles the harness itself otherwise (an older program has none).
_COMPILE_HARNESS = (
    "import importlib.util, marshal, runpy, sys\n"
    "space = runpy.run_path(sys.argv[1], run_name='rollout-harness')\n"
    "if 'harness_source' in space:\n"
    "    source = space['harness_source']().encode()\n"
    "    code = compile(source, 'harness.py', 'exec', dont_inherit=True)\n"
    "    head = importlib.util.MAGIC_NUMBER + (1).to_bytes(4, 'little')\n"
    "    head += importlib.util.source_hash(source)\n"
    "    with open(sys.argv[2], 'wb') as out:\n"
    "        out.write(head + marshal.dumps(code))\n"
)
HARNESS_COMPILED = "harness.pyc"  # as the runner names it (harness_program.HARNESS_COMPILED)


def episode_program_text() -> str:
    """The program every sandbox runs: the runner package built into one file (built once a
    process; warm-pool keys and ConfigMaps are made of these bytes)."""
    return build_program()


def compiled_path(source: Path) -> Path:
    return source.with_suffix(".pyc")


def compile_program(source: Path, python: str) -> bool:
    """Write `source`'s bytecode beside it, compiled by the interpreter that will run it (the
    format is that interpreter's own), and its test harness's (harness.pyc). A script is
    otherwise compiled anew at every start: about 17 ms of CPU of a short episode's 0.2 s, and
    the harness once an episode. False when it cannot be compiled: the sandboxes then run the
    source, which is only slower."""
    target = compiled_path(source)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    harness = source.with_name(HARNESS_COMPILED)
    harness_tmp = harness.with_name(f"{harness.name}.{os.getpid()}.tmp")
    harness.unlink(missing_ok=True)  # another program's (the runner would refuse it anyway)
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
    try:
        subprocess.run(
            [python, "-I", "-c", _COMPILE_HARNESS, str(source), str(harness_tmp)],
            capture_output=True,
            timeout=60,
            check=True,
        )
        if harness_tmp.exists():
            harness_tmp.chmod(0o644)
            os.replace(harness_tmp, harness)
    except (OSError, subprocess.SubprocessError):
        harness_tmp.unlink(missing_ok=True)  # the runner compiles its harness itself
    return True

"""The test harness as a program of its own: its source, cut from this program's files, and its
bytecode (the local backend's, compiled beside the program, or compiled here once a process),
written with each run's harness."""

from __future__ import annotations

import functools
import os
import sys
import types
import typing

HARNESS_BEGIN = "# -- harness: begin"
# The modules holding the harness's parts, in the assembled program's order.
HARNESS_PARTS = ("comparisons", "vault", "harness")
HARNESS_END = "# -- harness: end"
# Interpreter flags that change what a compiler makes (asserts and docstrings stripped): the
# bytecode is compiled as the test command's interpreter would compile the source.
OPTIMIZE_FLAGS = {"-O": 1, "-OO": 2}
# The harness's bytecode beside the program, when a backend compiled it there (the local one:
# rollout_worker.sandbox.compile_program, mounted read-only beside /sandbox/episode.pyc).
HARNESS_COMPILED = "harness.pyc"
MAX_HARNESS_BYTECODE = 1 << 20
# The shipped bytecode's code, once taken (take_shipped_harness): {"code": code}.
SHIPPED_HARNESS: dict = {}


@functools.lru_cache(maxsize=1)
def harness_source() -> str:
    """The harness as a program of its own: the parts between the markers of HARNESS_PARTS (in
    that order in the assembled program too), their imports, its main. Read once a process:
    the program's files do not change under it."""
    # Run as its compiled bytecode, the program's source lies beside it.
    here = os.path.abspath(__file__[:-1] if __file__.endswith(".pyc") else __file__)
    files = [here]
    if os.path.basename(here) == "harness_program.py":  # the package, not the assembled program
        files = [os.path.join(os.path.dirname(here), f"{m}.py") for m in HARNESS_PARTS]
    parts = []
    for path in files:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        # Markers only at the start of a line (the constants above hold them in quotes).
        for part in text.split("\n" + HARNESS_BEGIN)[1:]:
            parts.append(HARNESS_BEGIN + part[: part.index("\n" + HARNESS_END)])
    head = "from __future__ import annotations\nimport os, sys\n"
    return head + "\n".join(parts) + "\nsys.exit(harness(sys.argv[1:]))\n"


def pyc_magic() -> tuple[bytes, typing.Callable[[bytes], bytes]]:
    """This interpreter's bytecode magic and its source hash, as importlib.util has them,
    from the import machinery the interpreter started with: importing importlib.util costs
    about 1 ms of CPU, a grade's. importlib.util where that machinery is not CPython's."""
    import _imp

    machinery: typing.Any = sys.modules.get("_frozen_importlib_external")
    key = getattr(machinery, "_RAW_MAGIC_NUMBER", None)
    if isinstance(key, int) and hasattr(_imp, "source_hash"):
        return machinery.MAGIC_NUMBER, functools.partial(_imp.source_hash, key)
    import importlib.util

    return importlib.util.MAGIC_NUMBER, importlib.util.source_hash


def take_shipped_harness(folder: str | None = None) -> bool:
    """Take the harness's bytecode a backend compiled beside this program (`folder` in tests)
    when it is this interpreter's (its magic) and of this program's harness (its source's
    hash): otherwise it is compiled here when first needed. Called as the grader starts,
    before any agent runs: the bytes kept are never read again from where an agent was."""
    import marshal

    here = os.path.abspath(__file__[:-1] if __file__.endswith(".pyc") else __file__)
    path = os.path.join(folder or os.path.dirname(here), HARNESS_COMPILED)
    magic, source_hash = pyc_magic()
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_HARNESS_BYTECODE)
    except OSError:
        return False
    # Header: magic, flags (0b01: by the source's hash, unchecked), the source's hash.
    if data[:4] != magic or data[4:8] != (1).to_bytes(4, "little"):
        return False
    try:
        if data[8:16] != source_hash(harness_source().encode()):
            return False
        code = marshal.loads(data[16:])
    except (OSError, EOFError, ValueError, TypeError):  # no source beside, bytes cut short
        return False
    if type(code) is not types.CodeType:
        return False
    SHIPPED_HARNESS["code"] = code
    return True


@functools.lru_cache(maxsize=3)
def _harness_code(optimize: int) -> types.CodeType:
    # Compiling the harness is most of what it adds to a test run: never in a test
    # interpreter, here only without the backend's bytecode, and then once a process (a
    # runner grades twice, the baseline and the final run).
    if optimize == 0 and "code" in SHIPPED_HARNESS:
        return SHIPPED_HARNESS["code"]
    return compile(harness_source(), "harness.py", "exec", dont_inherit=True, optimize=optimize)


def _named(code: types.CodeType, filename: str) -> types.CodeType:
    """`code` and every code object within it naming `filename` as their file: the vault
    trusts frames by their file (the harness's folder), tracebacks show its lines."""
    inner = tuple(_named(c, filename) if type(c) is types.CodeType else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=inner)


def write_harness(folder: str, flags: list) -> str:
    """The harness written into `folder` (made anew for the run, after the agent is gone): its
    source and its bytecode for this interpreter, which runs the tests (the bytecode is
    never checked against the source). The path to run."""
    import marshal

    optimize = min(2, sum(OPTIMIZE_FLAGS.get(flag, 0) for flag in flags))  # -O -O is -OO
    source = os.path.join(folder, "harness.py")
    with open(source, "w", encoding="utf-8") as handle:
        handle.write(harness_source())
    compiled = os.path.join(folder, "harness.pyc")
    # A pyc's header: the interpreter's magic, flags 0b01 (by hash, never checked), the hash.
    header = pyc_magic()[0] + (1).to_bytes(4, "little") + bytes(8)
    with open(compiled, "wb") as handle:
        handle.write(header + marshal.dumps(_named(_harness_code(optimize), source)))
    return compiled

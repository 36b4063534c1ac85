"""The episode program is built from the runner package: reproducibly, into one file of the
standard library alone, with every module in it and no two defining the same name."""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import pytest

from rollout_worker.sandbox import episode_program_text, program
from tests.runner_program import episode

RUNNER = resources.files(program.PACKAGE)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def runner_modules() -> dict[str, str]:
    return {
        entry.name[:-3]: entry.read_text(encoding="utf-8")
        for entry in RUNNER.iterdir()
        if entry.name.endswith(".py") and entry.name != "__init__.py"
    }


def top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_two_builds_are_byte_identical():
    first = episode_program_text()
    program.build_program.cache_clear()
    assert program.build_program() == first
    lines = first.splitlines()
    assert first.startswith('"""') and lines.count("from __future__ import annotations") == 1


def test_the_program_compiles_and_imports_only_the_standard_library():
    text = episode_program_text()
    tree = ast.parse(text)
    compile(text, "episode.py", "exec")
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "an import of the runner package was left in the program"
            imported.add(str(node.module).split(".")[0])
    # pytest (and its _pytest): the harness imports them for a task whose test command is
    # `python -m pytest`.
    assert imported - {"__future__", "pytest", "_pytest"} <= sys.stdlib_module_names


def test_every_runner_module_is_built_in_once():
    assert sorted(program.RUNNER_MODULES) == sorted(runner_modules())
    assert len(set(program.RUNNER_MODULES)) == len(program.RUNNER_MODULES)


def test_a_module_imports_only_from_modules_built_before_it():
    order = {name: index for index, name in enumerate(program.RUNNER_MODULES)}
    for name, text in runner_modules().items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                assert order[str(node.module)] < order[name], (name, node.module)


def test_no_two_runner_modules_define_the_same_name():
    owner: dict[str, str] = {}
    imported: set[str] = set()
    for name, text in sorted(runner_modules().items()):
        tree = ast.parse(text)
        for node in tree.body:
            if isinstance(node, ast.Import):
                imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.update(alias.asname or alias.name for alias in node.names)
        for defined in top_level_names(tree):
            assert defined not in owner, f"{defined} in both {owner[defined]} and {name}"
            owner[defined] = name
    assert not imported & set(owner), "a runner name hides a standard-library import"


def test_the_runner_modules_and_functions_stay_small():
    for name, text in runner_modules().items():
        assert len(text.splitlines()) <= MAX_MODULE_LINES, name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                assert size <= MAX_FUNCTION_LINES, f"{name}.{node.name}: {size} lines"


def test_the_harness_part_runs_alone_with_its_own_imports():
    source = episode.harness_source()
    compile(source, "harness.py", "exec")
    tree = ast.parse(source)
    defined = top_level_names(tree)
    assert {"harness", "_unittest_recorder", "_pytest_recorder"} <= defined
    assert "harness_source" not in defined and "Runner" not in defined


def test_a_lazy_module_runs_only_when_first_imported():
    # A fresh interpreter: this one has imported http.server for its own tests.
    check = """
import sys
space = {"__name__": "episode", "__file__": sys.argv[1]}
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), space)
before = sorted({"http.server", "socketserver", "typing"} & set(sys.modules))
Proxy, = space["lazy_module"]("proxy", "Proxy")
again, = space["lazy_module"]("proxy", "Proxy")
print(before, again is Proxy, Proxy.__qualname__, space["ProxyServer"].__qualname__,
      Proxy.__init__.__globals__ is space,
      space["STALE_ANSWER"] == space["error_body"](space["STALE_ANSWER"]["error"]["message"],
                                                   space["STALE_ANSWER"]["error"]["type"]))
"""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "episode.py"
        path.write_text(episode_program_text(), encoding="utf-8")
        shown = subprocess.run(
            [sys.executable, "-I", "-c", check, str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    assert shown == ["[]", "True", "Proxy", "ProxyServer", "True", "True"]


def test_the_runner_imports_from_the_proxy_only_where_it_is_needed():
    text = episode_program_text()
    head = text[: text.index("# -- runner/")]
    assert "http.server" not in head and "socketserver" not in head and "typing" not in head
    assert text.count("lazy_module('proxy', 'Proxy')") == 1  # runner.py's act()


def test_typing_is_kept_only_where_it_is_read_outside_annotations():
    only_annotations = (
        "import typing\n\ndef f(x: typing.Any) -> typing.Any:\n    y: typing.Any = x\n"
    )
    assert program.split_module(only_annotations)[0] == []
    read = only_annotations + "    return typing.cast(int, y)\n"
    assert [ast.unparse(node) for node in program.split_module(read)[0]] == ["import typing"]


def test_the_build_refuses_what_a_lazy_module_cannot_hold():
    later = "def f():\n    from .policy import Policy\n    return Policy\n"
    with pytest.raises(ValueError, match="only a lazy module"):
        program.split_module(later)
    with pytest.raises(ValueError, match="a string over lines"):
        program.lazy_body("proxy", 'TEXT = """one\ntwo"""\n')
    with pytest.raises(ValueError, match="an annotated name"):
        program.lazy_body("proxy", "LIMIT: int = 3\n")
    lazy = program.lazy_body("proxy", '"""Doc\nstring."""\nimport json\n\nLIMIT = json.dumps(3)\n')
    assert lazy.startswith("def _lazy_proxy() -> None:\n    global LIMIT, json\n    import json\n")

"""The episode program built from the runner package: one standard-library file.

Sandboxes run a single file (a ConfigMap key on Kubernetes, a file the local backend writes
and compiles), so the modules of `runner/` are concatenated in RUNNER_MODULES' order: the
package's docstring, `from __future__ import annotations` once, the modules' standard-library
imports merged and sorted, then each module's body as written (its docstring, imports and
`if typing.TYPE_CHECKING:` block dropped). Every module shares one namespace once built, which
is why no two modules may define the same top-level name (tests/unit/test_runner_program.py).
The build is a pure function of the package's files: the same bytes on every machine.
"""

from __future__ import annotations

import ast
import functools
from importlib import resources

PACKAGE = "rollout_worker.sandbox.runner"
# Each module after those it imports from: a module's top-level statements (a constant made
# from another's function, a class's base) see only what came before them.
RUNNER_MODULES = (
    "errors",
    "cost",
    "events",
    "demo",
    "stream",
    "steps",
    "policy",
    "workspace",
    "processes",
    "health",
    "comparisons",
    "vault",
    "harness",
    "harness_program",
    "judging",
    "rewards",
    "artifacts",
    "taskenv",
    "grader",
    "handoff",
    "seed",
    "task",
    "loop",
    "proxy_server",
    "proxy",
    "multistep",
    "runner",
    "main",
)


def module_text(name: str) -> str:
    return resources.files(PACKAGE).joinpath(f"{name}.py").read_text(encoding="utf-8")


def _type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def split_module(text: str) -> tuple[list[ast.Import | ast.ImportFrom], str]:
    """(a module's standard-library imports, its body without docstring, imports and
    type-checking block)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    dropped: set[int] = set()
    imports: list[ast.Import | ast.ImportFrom] = []
    for index, node in enumerate(tree.body):
        docstring = (
            index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        )
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import) or (node.level == 0 and node.module != "__future__"):
                imports.append(node)
        elif not (docstring or _type_checking(node)):
            continue
        assert node.end_lineno is not None
        dropped.update(range(node.lineno - 1, node.end_lineno))
    body = "".join(line for number, line in enumerate(lines) if number not in dropped)
    return imports, body.strip("\n")


def merged_imports(nodes: list[ast.Import | ast.ImportFrom]) -> str:
    """`import x` lines, then `from x import a, b` lines, each sorted and said once."""
    plain: set[str] = set()
    named: dict[str, set[str]] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            plain.update(ast.unparse(alias) for alias in node.names)
        else:
            named.setdefault(str(node.module), set()).update(
                ast.unparse(alias) for alias in node.names
            )
    lines = [f"import {name}" for name in sorted(plain)]
    lines += [
        f"from {module} import {', '.join(sorted(named[module]))}" for module in sorted(named)
    ]
    return "\n".join(lines) + "\n"


def program_docstring() -> str:
    """The package's docstring as written in runner/__init__.py (its quotes included)."""
    text = module_text("__init__")
    node = ast.parse(text).body[0]
    assert isinstance(node, ast.Expr) and node.end_lineno is not None
    return "".join(text.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno])


@functools.lru_cache(maxsize=1)
def build_program() -> str:
    imports: list[ast.Import | ast.ImportFrom] = []
    bodies = []
    for name in RUNNER_MODULES:
        found, body = split_module(module_text(name))
        imports += found
        bodies.append(f"# -- runner/{name}.py\n{body}\n")
    head = f"{program_docstring()}\nfrom __future__ import annotations\n\n"
    return head + merged_imports(imports) + "\n\n" + "\n\n".join(bodies)

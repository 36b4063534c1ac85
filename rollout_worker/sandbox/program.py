"""The episode program built from the runner package: one standard-library file.

Sandboxes run a single file (a ConfigMap key on Kubernetes, a file the local backend writes
and compiles), so the modules of `runner/` are concatenated in RUNNER_MODULES' order: the
package's docstring, `from __future__ import annotations` once, the modules' standard-library
imports merged and sorted, then each module's body as written (its docstring, imports and
`if typing.TYPE_CHECKING:` block dropped). Every module shares one namespace once built, which
is why no two modules may define the same top-level name (tests/unit/test_runner_program.py).
`import typing` is left out of a module that names typing only in annotations (never evaluated
under `from __future__ import annotations`). A module of LAZY_MODULES runs only when a
function first imports from it (`from .proxy import Proxy` inside a function, rewritten to
`lazy_module`): its body and its own imports sit in a function declaring its names global.
The build is a pure function of the package's files: the same bytes on every machine.
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
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
    "http1",
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
# Modules only some episodes need, run when first imported from inside a function: the agent
# command's proxy, whose server imports http.server (http.client, email: about a fifth of
# what the runner's start costs in instructions) for nothing in any other mode.
LAZY_MODULES = ("proxy_server", "proxy")
# Emitted once, before the first lazy module: runs a lazy module's body (which first loads
# the lazy modules it imports from) once a process, then hands over the names asked for.
LAZY_LOADER = """LAZY_LOADED: set = set()


def lazy_module(module: str, *names: str) -> tuple:
    if module not in LAZY_LOADED:
        globals()["_lazy_" + module]()
        LAZY_LOADED.add(module)
    return tuple(globals()[name] for name in names)
"""


def module_text(name: str) -> str:
    return resources.files(PACKAGE).joinpath(f"{name}.py").read_text(encoding="utf-8")


def _type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def _annotation_only(tree: ast.Module, name: str) -> bool:
    """Whether `name` is read only in annotations (type-checking blocks aside)."""
    skipped: set[int] = set()
    for top in tree.body:
        if _type_checking(top):
            skipped.update(id(n) for n in ast.walk(top))
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in filter(None, annotations):
            skipped.update(id(n) for n in ast.walk(annotation))
    return not any(
        isinstance(node, ast.Name) and node.id == name and id(node) not in skipped
        for node in ast.walk(tree)
    )


def _lazy_imports(tree: ast.Module, lines: list[str]) -> dict[int, str]:
    """Each import from a lazy module inside a function, as the line that loads it: {line
    index: its new text}, "" for a statement's further lines."""
    rewritten: dict[int, str] = {}
    for top in tree.body:
        for node in ast.walk(top):
            if node is top or not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            if node.module not in LAZY_MODULES or node.level != 1:
                raise ValueError(f"line {node.lineno}: only a lazy module is imported later")
            indent = lines[node.lineno - 1][: node.col_offset]
            if indent.strip():
                raise ValueError(f"line {node.lineno}: a lazy import on a line of its own")
            bound = "".join(f"{alias.asname or alias.name}, " for alias in node.names)
            asked = ", ".join(repr(alias.name) for alias in node.names)
            assert node.end_lineno is not None
            rewritten.update(dict.fromkeys(range(node.lineno, node.end_lineno), ""))
            rewritten[node.lineno - 1] = (
                f"{indent}({bound.rstrip()}) = lazy_module({node.module!r}, {asked})\n"
            )
    return rewritten


def split_module(text: str) -> tuple[list[ast.Import | ast.ImportFrom], str]:
    """(a module's standard-library imports, its body without docstring, imports and
    type-checking block; its imports from lazy modules inside functions rewritten)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    dropped: set[int] = set()
    imports: list[ast.Import | ast.ImportFrom] = []
    typing_unused = _annotation_only(tree, "typing")
    for index, node in enumerate(tree.body):
        docstring = (
            index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        )
        if isinstance(node, ast.Import):
            if not (typing_unused and ast.unparse(node) == "import typing"):
                imports.append(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module != "__future__":
                imports.append(node)
        elif not (docstring or _type_checking(node)):
            continue
        assert node.end_lineno is not None
        dropped.update(range(node.lineno - 1, node.end_lineno))
    rewritten = _lazy_imports(tree, lines)
    body = "".join(
        rewritten.get(number, line) for number, line in enumerate(lines) if number not in dropped
    )
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


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module's top level binds (its own imports' too)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            # `global x` then `x: T = v` is a syntax error.
            raise ValueError(f"line {node.lineno}: an annotated name in a lazy module")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.For, ast.With)):
            names.update(
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            )
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.update(alias.asname or alias.name for alias in node.names)
    return names - {"annotations"}


def _check_indentable(text: str, tree: ast.Module) -> None:
    """A lazy module's body is indented into its loader: no string but a docstring may span
    lines (its text would change)."""
    docstrings = {
        (node.body[0].lineno, node.body[0].col_offset)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        spans = token.type == tokenize.STRING and token.start[0] != token.end[0]
        if spans and token.start not in docstrings:
            raise ValueError(f"line {token.start[0]}: a string over lines in a lazy module")


def lazy_body(name: str, text: str) -> str:
    """A lazy module as the function that runs it, its names declared global so that it binds
    them as the module's top level would (and its functions read them as globals)."""
    tree = ast.parse(text)
    _check_indentable(text, tree)
    found, body = split_module(text)
    needed = [
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in LAZY_MODULES
    ]
    head = [f"global {', '.join(sorted(_bound_names(tree)))}"]
    head += [f"lazy_module({module!r})" for module in needed]
    head += merged_imports(found).splitlines() if found else []
    inner = "\n".join(head) + "\n\n" + body
    indented = "".join(
        f"    {line}" if line.strip() else line for line in inner.splitlines(keepends=True)
    )
    return f"def _lazy_{name}() -> None:\n{indented}"


@functools.lru_cache(maxsize=1)
def build_program() -> str:
    imports: list[ast.Import | ast.ImportFrom] = []
    bodies: list[str] = []
    for name in RUNNER_MODULES:
        if name in LAZY_MODULES:
            if not any(LAZY_LOADER in b for b in bodies):
                bodies.append(f"# -- the lazy modules' loader (program.py)\n{LAZY_LOADER}")
            body = lazy_body(name, module_text(name))
            bodies.append(f"# -- runner/{name}.py, run when first imported\n{body}\n")
            continue
        found, body = split_module(module_text(name))
        imports += found
        bodies.append(f"# -- runner/{name}.py\n{body}\n")
    head = f"{program_docstring()}\nfrom __future__ import annotations\n\n"
    return head + merged_imports(imports) + "\n\n" + "\n\n".join(bodies)

"""The import arrows of the layers: what each kind of process loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


def loaded(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {name.split(".")[0] for name in out.split()}


def test_the_trainer_side_loads_no_worker_and_no_kubernetes():
    modules = loaded("from trainer_stub import submit_batch, RolloutClient")
    assert not modules & {"rollout_worker", "kubernetes", "matplotlib"}


def test_the_wire_package_loads_nothing_of_either_side():
    modules = loaded(
        "import rollout_wire.codec, rollout_wire.request, rollout_wire.rows, rollout_wire.errors"
    )
    assert not modules & {"rollout_worker", "trainer_stub", "celery", "redis", "kubernetes"}


@pytest.mark.parametrize(
    "entry",
    [
        # What `rollout worker` runs before Celery takes over, and the tasks it registers.
        "from rollout_worker.cli.main import cli\n"
        "from rollout_worker.celery_app import create_app\n"
        "from rollout_worker.settings import Settings; create_app(Settings())",
        # The local supervisor process.
        "import rollout_worker.backends.local.supervisor",
    ],
)
def test_worker_processes_load_no_plotting_or_terminal_library(entry):
    assert not loaded(entry) & {"matplotlib", "rich", "trainer_stub"}


def test_the_local_supervisor_loads_no_kubernetes_client():
    assert "kubernetes" not in loaded("import rollout_worker.backends.local.supervisor")


def test_the_sandbox_host_agent_loads_no_kubernetes_client_nor_celery():
    # It runs in host Pods that hold no API token, beside hostile sandboxes: no client to use.
    modules = loaded("import rollout_worker.backends.host.agent")
    assert not modules & {"kubernetes", "celery", "matplotlib", "rich", "trainer_stub"}


# -- the import graph of the source, read statically (lazy imports inside functions too) ----
ROOT = Path(__file__).resolve().parents[2]

# Floors of rollout_worker, lowest first: a module may import its own floor or lower ones.
# Within a floor the graph must still have no circle.
FLOORS: list[tuple[str, ...]] = [
    (
        "rollout_worker.settings",
        "rollout_worker.quantities",
        "rollout_worker.observation",
        "rollout_worker.metrics",
        "rollout_worker.schedule",
        "rollout_worker.store",
        "rollout_worker.sandbox",
    ),
    ("rollout_worker.validation", "rollout_worker.backends.base", "rollout_worker.backends.warm"),
    (
        "rollout_worker.report",
        "rollout_worker.backends.local",
        "rollout_worker.backends.kube",
        "rollout_worker.backends.host",  # imports local, never kube (the host Pods load no client)
    ),
    ("rollout_worker.backends",),  # the package itself: get_backend
    ("rollout_worker.core",),
    ("rollout_worker.tasks",),
    ("rollout_worker.celery_app",),
    ("rollout_worker.cli",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, at any depth of its code."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = module_name(path)
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
                # `from pkg import module` names a module when one exists by that name; a
                # relative import (the runner's package) counts from its own package.
                base = node.module or ""
                if node.level:
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    is_module = (ROOT / full.replace(".", "/")).with_suffix(".py").exists() or (
                        ROOT / full.replace(".", "/") / "__init__.py"
                    ).exists()
                    edges.add(full if is_module else base)
        graph[name] = {e for e in edges if e == package or e.startswith(package + ".")} - {name}
    return graph


def floor_of(module: str) -> int:
    best, floor = -1, -1
    for number, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), number
    assert floor >= 0, f"{module} is on no floor: add it to FLOORS"
    return floor


def test_every_import_of_the_worker_points_down_a_floor_or_stays_on_its_own():
    graph = import_graph("rollout_worker")
    upward = [
        f"{a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if floor_of(b) > floor_of(a)
    ]
    assert upward == []


def test_the_worker_has_no_import_circle_not_even_through_a_lazy_import():
    graph = import_graph("rollout_worker")
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path, node]))
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_the_local_backend_never_passes_through_kubernetes_code_nor_the_reverse():
    graph = import_graph("rollout_worker")
    local, kube = "rollout_worker.backends.local", "rollout_worker.backends.kube"
    crossing = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if (a.startswith(local) and b.startswith(kube))
        or (a.startswith(kube) and b.startswith(local))
    ]
    assert crossing == []


def test_the_host_backend_never_passes_through_kubernetes_code():
    graph = import_graph("rollout_worker")
    host, kube = "rollout_worker.backends.host", "rollout_worker.backends.kube"
    crossing = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if (a.startswith(host) and b.startswith(kube))
        or (a.startswith(kube) and b.startswith(host))
    ]
    assert crossing == []


def test_the_graph_reader_sees_lazy_imports_and_module_imports():
    # The checks above are only as good as this reader: a function-level import and a
    # `from package import module` must both be edges.
    graph = import_graph("rollout_worker")
    assert "rollout_worker.tasks" in graph["rollout_worker.celery_app"]  # lazy, in create_app
    assert "rollout_worker.backends.local.backend" in graph["rollout_worker.backends"]
    runner = "rollout_worker.sandbox.runner"
    assert f"{runner}.proxy_server" in graph[f"{runner}.proxy"]  # `from .proxy_server import`


# -- sizes: rooms a newcomer can read in one sitting -------------------------------------------
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
PRODUCT = ("rollout_wire", "rollout_worker", "trainer_stub")


def oversized(text: str, where: str) -> dict[str, int]:
    """Lines of the module `text` if past MAX_MODULE_LINES, and of each of its functions past
    MAX_FUNCTION_LINES (as `where::Qualified.name`, methods and nested functions included)."""
    found: dict[str, int] = {}
    if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
        found[where] = lines
    stack: list[tuple[ast.AST, str]] = [(ast.parse(text), "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            name = getattr(child, "name", None)
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found[f"{where}::{prefix}{name}"] = length
            stack.append((child, f"{prefix}{name}." if isinstance(name, str) else prefix))
    return found


def sizes() -> dict[str, int]:
    found: dict[str, int] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            found |= oversized(path.read_text(), path.relative_to(ROOT).as_posix())
    return found


def test_no_module_past_600_lines_and_no_function_past_80():
    # Split along concepts when one grows past a limit, not in halves (issue 47).
    assert sizes() == {}


def test_the_size_reader_sees_methods_nested_functions_and_long_modules():
    body = "".join(f"        x = {n}\n" for n in range(MAX_FUNCTION_LINES))
    text = (
        "class Room:\n    def long(self):\n"
        + body
        + "def outer():\n    def inner():\n"
        + body
        + "    return inner\n"
        + "\n" * MAX_MODULE_LINES
    )
    found = oversized(text, "x.py")
    assert set(found) == {"x.py", "x.py::Room.long", "x.py::outer", "x.py::outer.inner"}
    assert found["x.py::Room.long"] == MAX_FUNCTION_LINES + 1

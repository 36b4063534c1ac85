"""The benchmarks as a package: every module imports, every entry point answers --help, and the
shared harness computes what it says on fixed inputs (the figures quoted in notes depend on it)."""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks import harness
from benchmarks.harness import Columns, Figures, Loads, Stats, cell, markdown_table, percentile

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__))
# Modules with a command line of their own (the rest are aids the benchmarks import).
ENTRY_POINTS = [
    name for name in MODULES if hasattr(importlib.import_module(f"benchmarks.{name}"), "main")
]


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports(name: str) -> None:
    importlib.import_module(f"benchmarks.{name}")


def test_the_benchmarks_have_entry_points() -> None:
    assert {"bench_cost", "bench_kubernetes", "bench_pipeline", "bench_tail"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout[:200]


def test_stats_median_min_max() -> None:
    stats = Stats([3.0, 1.0, 2.0, 10.0])
    assert stats.median == 2.5
    assert stats.fmt() == "2.50 [1.00-10.00]"
    assert stats.fmt(scale=100, digits=1) == "250.0 [100.0-1000.0]"


def test_cell() -> None:
    assert cell([]) == "-"
    assert cell(None) == "-"
    assert cell([None, float("nan")]) == "-"
    assert cell([1.5]) == "1.50 (1 run)"
    assert cell([1.5], one_run=False) == "1.50 [1.50-1.50]"
    assert cell([0.001, 0.003, float("nan"), 0.002, None], 1, scale=1000) == "2.0 [1.0-3.0]"


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 21)]  # 1..20
    assert percentile(values, 0.5) == 11.0  # round(0.5 * 19) = 10 (banker's), index 10
    assert percentile(values, 0.95) == 19.0  # round(18.05) = 18
    assert harness.p95(values) == 19.0
    assert percentile([7.0], 0.95) == 7.0


def test_figures_keep_order_and_show_percent() -> None:
    figures = Figures()
    for value in (1.0, 3.0, 2.0):
        figures.add("wall s", value)
        figures.add("overhead %", value / 100)
    assert figures.median("wall s") == 2.0
    assert figures["overhead %"] == [0.01, 0.03, 0.02]
    assert figures.lines(width=12) == [
        "  wall s       2.000 [1.000-3.000]",
        "  overhead %   2.000 [1.000-3.000]",
    ]


def test_columns_line() -> None:
    table = Columns(label=10, width=8)
    assert table.line("figure", ["a", "bb"], "goal") == "figure           a      bb   goal"
    assert table.line("x", []) == "x            "


def test_markdown_table() -> None:
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_loads_are_the_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([(1.0, 0.5, 0.25), (2.0, 1.0, 0.5)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(readings))
    loads = Loads()
    assert loads.stop().line() == ("load average at start (1.0, 0.5, 0.25), at end (2.0, 1.0, 0.5)")


def test_rounds_are_at_least_three() -> None:
    parser = harness.new_parser("doc")
    harness.require_rounds(parser, 3)
    with pytest.raises(SystemExit):
        harness.require_rounds(parser, 2)


def test_json_records(tmp_path: Path) -> None:
    handle = io.StringIO()
    harness.append_json(handle, {"a": 1, "b": math.inf})
    harness.append_json(handle, [1])
    assert handle.getvalue() == '{"a": 1, "b": Infinity}\n[1]\n'
    harness.write_json(tmp_path / "out.json", {"b": 1, "a": 2})
    assert json.loads((tmp_path / "out.json").read_text()) == {"a": 2, "b": 1}


def test_the_program_swap_gives_workers_another_episode_program(tmp_path: Path) -> None:
    # bench_grading --real-node's seam: the workers' backends build their ConfigMaps from it.
    program = tmp_path / "before.py"
    program.write_text("# another revision's program\n")
    code = "from rollout_worker.sandbox import episode_program_text as p; print(p(), end='')"
    swap = ROOT / "benchmarks" / "program_swap"
    env = dict(os.environ, PYTHONPATH=f"{swap}:{ROOT}", ROLLOUT_BENCH_PROGRAM=str(program))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout == program.read_text(), done.stderr
    env.pop("ROLLOUT_BENCH_PROGRAM")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.startswith('"""'), done.stderr  # today's program without it

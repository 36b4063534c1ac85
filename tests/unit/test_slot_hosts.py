"""bench_slots' pure summary code for pods, hosts and local side by side
(benchmarks/slot_hosts.py): the per-round ratios, the goals and the side-by-side table."""

from __future__ import annotations

import pytest

from benchmarks.slot_hosts import free_slots, goal_lines, ratios, side_by_side


def test_ratios_of_a_round_with_pods_hosts_and_local() -> None:
    walls = {"pods": 60.0, "hosts": 30.0, "local": 25.0}
    cpu = {"pods": 2.0, "hosts": 0.6, "local": 0.5}
    got = ratios(walls, cpu)
    assert got["hosts / local"] == pytest.approx(1.2)
    assert got["hosts / local machine CPU"] == pytest.approx(1.2)
    assert got["pods / hosts"] == pytest.approx(2.0)
    assert got["pods / hosts machine CPU"] == pytest.approx(2.0 / 0.6)
    assert got["pods / local"] == pytest.approx(2.4)
    # No before side ran: its ratios are left out rather than made up.
    assert "pods / before" not in got and "pods / before machine CPU" not in got


def test_ratios_leave_out_a_zero_denominator() -> None:
    got = ratios({"hosts": 3.0, "local": 2.0}, {"hosts": 0.1, "local": 0.0})
    assert got == {"hosts / local": 1.5}


def test_goal_lines_say_met_or_missed() -> None:
    lines = goal_lines({"hosts / local": 1.31, "hosts / local machine CPU": 1.2, "x": 9.0})
    assert lines == [
        "goal hosts / local <= 1.30: MISSED (1.31)",
        "goal hosts / local machine CPU <= 1.20: met (1.20)",
    ]
    assert goal_lines({"pods slot utilisation": 0.5}) == [
        "goal pods slot utilisation >= 0.60: MISSED (0.50)"
    ]


def test_side_by_side_puts_each_side_in_its_column() -> None:
    figures = {
        "pods submit -> report s": [60.0, 50.0, 70.0],
        "hosts submit -> report s": [30.0],
        "local submit -> report s": [20.0, 30.0],
        "pods warm episodes": [162.0],
        "hosts / local": [1.2],  # a ratio, not a side's figure
        "pods: least wall on this node s": [40.0],
    }
    lines = side_by_side(figures, ["pods", "hosts", "local"])
    assert lines[0].split() == ["median", "pods", "hosts", "local"]
    assert lines[1].split()[-3:] == ["60.00", "30.00", "20.00"]  # the lower median of two
    assert lines[2].split()[-3:] == ["162", "-", "-"]
    assert len(lines) == 3


def test_free_slots_leaves_out_draining_hosts() -> None:
    beats = {
        "a": {"slots": 5, "free": 5},
        "b": {"slots": 5, "free": 2},
        "c": {"slots": 5, "free": 5, "draining": True},
    }
    assert free_slots(beats) == 7

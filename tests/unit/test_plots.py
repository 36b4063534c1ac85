"""The timeline plot and the shareable summary, from a synthetic report built like results.json."""

from __future__ import annotations

import base64
import re
import struct

import pytest
from click.testing import CliRunner

from rollout_worker.cli.plots import episode_timelines, render_timeline, run_origin, startup_seconds
from rollout_worker.cli.report import render_html, render_markdown, report, summary_tables
from rollout_worker.metrics import percentile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ORIGIN = 1_800_000_000.0


def make_report(count: int = 12, failed: tuple[int, ...] = (3, 7), kubernetes: bool = False):
    """A report shaped like metrics.build_report's, with made-up but consistent timings."""
    pods = []
    for i in range(count):
        created = ORIGIN + 0.1 + 0.05 * i
        scheduled = created + 0.02 if kubernetes else None
        ready = created + 0.2 + 0.01 * (i % 5)
        ok = i not in failed
        reward = ready + 0.4 if ok else None
        finished = (reward or ready + 0.3) + 0.05
        pods.append(
            {
                "index": i,
                "pod": f"rollout-synthetic-{i}",
                "status": "ok" if ok else "failed",
                "errors": [] if ok else [f"exit code 1 | reason Error #{i}"],
                "reward": 1 if ok else 0,
                "exit_code": 0 if ok else 1,
                "phase": "Succeeded" if ok else "Failed",
                "node": f"node-{i % 2}",
                "created_at": created,
                "ready_at": ready,
                "reward_at": reward,
                "finished_at": finished,
                "pod_to_ready_seconds": ready - created,
                "batch_to_ready_seconds": ready - ORIGIN,
                "batch_to_reward_seconds": None if reward is None else reward - ORIGIN,
                "timing": {"scheduled_at": scheduled, "queue_seconds": created - ORIGIN},
            }
        )
    ok_rows = [p for p in pods if p["status"] == "ok"]
    startup = [p["pod_to_ready_seconds"] for p in pods]
    return {
        "batch_id": "synthetic",
        "ok": not failed,
        "status": "failed" if failed else "succeeded",
        "errors": [f"episode {p['index']} ({p['pod']}) failed" for p in pods if p not in ok_rows],
        "warnings": ["local sandboxes are NOT isolated: test"],
        "episodes": count,
        "successful_episodes": len(ok_rows),
        "failed_episodes": count - len(ok_rows),
        "lost_episodes": 0,
        "reward_sum": len(ok_rows),
        "parallelism": 4,
        "backend": "kubernetes" if kubernetes else "local",
        "image": "python:3.12-alpine",
        "batch_to_all_ready_seconds": max(p["batch_to_ready_seconds"] for p in pods)
        if pods
        else None,
        "batch_to_all_rewards_seconds": max(p["batch_to_reward_seconds"] for p in ok_rows)
        if ok_rows
        else None,
        "pod_to_ready_p50_seconds": percentile(startup, 0.5) if startup else None,
        "pod_to_ready_p95_seconds": percentile(startup, 0.95) if startup else None,
        "pod_to_ready_max_seconds": max(startup, default=None),
        "phases": {"queue": {"p50": 0.3, "p95": 0.6, "max": 0.65, "n": count}},
        "nodes": {"node-0": (count + 1) // 2, "node-1": count // 2},
        "run_created_at": ORIGIN,
        "pods": pods,
    }


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_timelines_are_seconds_since_the_run_started_in_index_order():
    data = make_report(kubernetes=True)
    data["pods"].reverse()
    rows = episode_timelines(data)
    assert [r.index for r in rows] == list(range(12))
    first = rows[0]
    assert first.created == pytest.approx(0.1)
    assert first.scheduled == pytest.approx(0.12)
    assert first.ready == pytest.approx(0.3)
    assert first.reward == pytest.approx(0.7)
    assert [r.index for r in rows if r.failed] == [3, 7]
    assert rows[3].reward is None and rows[3].end == pytest.approx(rows[3].finished)


def test_the_origin_falls_back_to_the_earliest_pod_and_bad_values_are_ignored():
    data = make_report(count=3, failed=())
    del data["run_created_at"]
    data["pods"][1]["ready_at"] = "not a time"
    assert run_origin(data) == pytest.approx(ORIGIN + 0.1)
    rows = episode_timelines(data)
    assert rows[0].created == 0.0 and rows[1].ready is None


def test_startup_seconds_fall_back_to_ready_minus_created():
    data = make_report(count=4, failed=())
    expected = [p["pod_to_ready_seconds"] for p in data["pods"]]
    for row in data["pods"]:
        row["pod_to_ready_seconds"] = None
    assert startup_seconds(data) == pytest.approx(expected)


@pytest.mark.parametrize(("count", "kubernetes"), [(12, False), (120, True), (0, False)])
def test_render_timeline_writes_a_png_that_grows_with_the_episodes(tmp_path, count, kubernetes):
    data = make_report(count=count, failed=(3, 7) if count else (), kubernetes=kubernetes)
    path = render_timeline(data, tmp_path / "timeline.png")
    width, height = png_size(path.read_bytes())
    assert width >= 1200 and height >= 600
    if count == 120:
        small = render_timeline(make_report(count=12), tmp_path / "small.png")
        assert height > png_size(small.read_bytes())[1]


def test_summary_tables_carry_the_metrics_phases_nodes_and_failures():
    data = make_report()
    tables = {t.title: t for t in summary_tables(data)}
    metrics = dict(tables["Metrics"].rows)
    assert metrics["episodes"] == "12"
    assert metrics["successful_episodes"] == "10"
    assert metrics["reward_sum"] == "10"
    assert metrics["pod_to_ready_p95_seconds"] == f"{data['pod_to_ready_p95_seconds']:.3f}"
    assert tables["Phases (seconds)"].rows == [("queue", "0.300", "0.600", "0.650", "12")]
    assert dict(tables["Nodes"].rows) == {"node-0": "6", "node-1": "6"}
    failed = tables["Failed episodes (2)"].rows
    assert [row[0] for row in failed] == ["3", "7"]
    assert "reason Error #3" in failed[0][-1]


def test_markdown_summary_escapes_table_cells_and_links_the_plot():
    text = render_markdown(make_report(), "timeline.png")
    assert text.startswith("# Batch synthetic: failed")
    assert "![timeline of batch synthetic](timeline.png)" in text
    assert "| reward_sum | 10 |" in text
    assert "exit code 1 \\| reason Error #7" in text  # a | inside a cell would split it
    assert "## Warnings" in text and "NOT isolated" in text


def test_html_summary_is_one_page_with_the_plot_inlined_and_text_escaped(tmp_path):
    data = make_report()
    data["errors"].append("<script>alert(1)</script>")
    png = render_timeline(data, tmp_path / "t.png").read_bytes()
    page = render_html(data, png)
    assert "<script>" not in page and "&lt;script&gt;" in page
    inlined = re.search(r'src="data:image/png;base64,([^"]+)"', page)
    assert inlined and base64.b64decode(inlined.group(1)) == png
    assert "<td>successful_episodes</td><td>10</td>" in page


def test_the_report_command_writes_the_plot_and_the_summary(tmp_path):
    import json

    records = tmp_path / "rl-12"
    records.mkdir()
    (records / "results.json").write_text(json.dumps(make_report()))
    plot, summary = tmp_path / "docs" / "t.png", tmp_path / "docs" / "summary.md"
    plot.parent.mkdir()
    result = CliRunner().invoke(
        report, [str(records), "--plot", str(plot), "--summary", str(summary)]
    )
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == PNG_MAGIC
    text = summary.read_text()
    assert "](t.png)" in text and "| successful_episodes | 10 |" in text

    printed = CliRunner().invoke(report, [str(records / "results.json")])
    assert printed.exit_code == 0 and "| failed_episodes | 2 |" in printed.output


def test_the_report_command_refuses_what_is_not_a_report(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text('{"hello": 1}')
    result = CliRunner().invoke(report, [str(bad)])
    assert result.exit_code == 2 and "not a batch report" in result.output
    bad.write_text("{")
    assert "is not JSON" in CliRunner().invoke(report, [str(bad)]).output
    good = tmp_path / "ok.json"
    good.write_text('{"pods": []}')
    result = CliRunner().invoke(report, [str(good), "--summary", str(tmp_path / "s.txt")])
    assert result.exit_code == 2 and "must end in .md or .html" in result.output

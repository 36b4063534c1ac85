"""`rollout report RESULTS.json`: a timeline plot and a shareable summary of a finished batch.

The summary is built as sections of plain data (pure), then rendered as Markdown or HTML.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import orjson

from rollout_wire.rows import REPORT_METRICS
from rollout_wire.states import EpisodeStatus
from rollout_worker.cli.plots import render_timeline

MAX_FAILED_ROWS = 50


@dataclass(frozen=True)
class Table:
    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]


def cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _when(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "—"


def headline(report: Mapping[str, Any]) -> str:
    return f"Batch {report.get('batch_id', '?')}: {report.get('status', 'unknown')}"


def facts(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    isolation = report.get("run_isolation") or (report.get("run") or {}).get("isolation")
    kubernetes = report.get("backend") == "kubernetes"
    pairs = [
        ("backend", report.get("backend")),
        # The requested image and RuntimeClass only mean something on Kubernetes; what ran is
        # in image_ids on every backend.
        ("image", report.get("image") if kubernetes else None),
        ("runtime", report.get("runtime") if kubernetes else None),
        ("image ids", ", ".join(report.get("image_ids") or []) or None),
        ("isolation", isolation),
        ("action", report.get("action")),
        ("run started", _when(report.get("run_created_at"))),
        ("finalized by", report.get("finalized_by")),
    ]
    return [(name, cell(value)) for name, value in pairs if value is not None]


def summary_tables(report: Mapping[str, Any]) -> list[Table]:
    """The metrics, the per-phase spread, the nodes, and every failed episode."""
    tables = [
        Table(
            "Metrics",
            ("metric", "value"),
            [(name, cell(report.get(name))) for name in REPORT_METRICS if name in report],
        )
    ]
    phases = report.get("phases") or {}
    if phases:
        tables.append(
            Table(
                "Phases (seconds)",
                ("phase", "p50", "p95", "max", "episodes"),
                [
                    (
                        name,
                        cell(p.get("p50")),
                        cell(p.get("p95")),
                        cell(p.get("max")),
                        cell(p.get("n")),
                    )
                    for name, p in phases.items()
                ],
            )
        )
    tables += cost_tables(report)
    nodes = report.get("nodes") or {}
    if nodes:
        tables.append(
            Table("Nodes", ("node", "episodes"), [(n, cell(c)) for n, c in sorted(nodes.items())])
        )
    failed = [row for row in report.get("pods") or [] if row.get("status") != EpisodeStatus.OK]
    if failed:
        tables.append(
            Table(
                f"Failed episodes ({len(failed)})",
                ("index", "pod", "status", "phase", "exit", "errors"),
                [
                    (
                        cell(row.get("index")),
                        cell(row.get("pod")),
                        cell(row.get("status")),
                        cell(row.get("phase")),
                        cell(row.get("exit_code")),
                        "; ".join(row.get("errors") or []) or "—",
                    )
                    for row in failed[:MAX_FAILED_ROWS]
                ],
            )
        )
    return tables


COST_HEADER = (
    "scope",
    "ledgers",
    "cpu s",
    "peak MiB",
    "turns",
    "prompt tokens",
    "completion tokens",
    "policy s",
    "cpu s / reward",
    "tokens / reward",
)


def _cost_row(scope: str, cost: Mapping[str, Any]) -> tuple[str, ...]:
    peak = cost.get("peak_memory_bytes")
    return (
        scope,
        f"{cell(cost.get('ledgers'))}/{cell(cost.get('episodes'))}",
        cell(cost.get("cpu_seconds")),
        cell(peak / 2**20 if isinstance(peak, (int, float)) else None),
        cell(cost.get("policy_turns")),
        cell(cost.get("prompt_tokens")),
        cell(cost.get("completion_tokens")),
        cell(cost.get("policy_seconds")),
        cell(cost.get("cpu_seconds_per_reward")),
        cell(cost.get("tokens_per_reward")),
    )


def cost_tables(report: Mapping[str, Any]) -> list[Table]:
    """The cost ledger: the batch's totals and each group's (rows that carried a ledger out of
    the rows), and the sandbox seconds per phase. None for a report without ledgers."""
    cost = report.get("cost")
    if not isinstance(cost, Mapping) or not cost.get("ledgers"):
        return []
    rows = [_cost_row("batch", cost)]
    for group in report.get("groups") or []:
        figures = group.get("cost")
        if isinstance(figures, Mapping) and len(report.get("groups") or []) > 1:
            rows.append(_cost_row(str(group.get("task_id") or group.get("group_id")), figures))
    tables = [Table("Cost", COST_HEADER, rows)]
    wall = cost.get("wall") or {}
    phases: list[tuple[str, ...]] = [
        (str(phase), cell(value)) for phase, value in wall.items() if value is not None
    ]
    if phases:
        tables.append(Table("Sandbox seconds per phase", ("phase", "seconds"), phases))
    return tables


def notes(report: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) as the report states them."""
    return list(report.get("errors") or []), list(report.get("warnings") or [])


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any], plot: str | None = None) -> str:
    lines = [f"# {headline(report)}", ""]
    lines += [f"- **{name}**: {_md_escape(value)}" for name, value in facts(report)]
    lines.append("")
    if plot:
        lines += [f"![timeline of batch {report.get('batch_id', '')}]({plot})", ""]
    for table in summary_tables(report):
        lines += [f"## {table.title}", ""]
        lines.append("| " + " | ".join(table.header) + " |")
        lines.append("| " + " | ".join("---" for _ in table.header) + " |")
        lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in table.rows]
        lines.append("")
    errors, warnings = notes(report)
    for title, items in (("Errors", errors), ("Warnings", warnings)):
        if items:
            lines += [f"## {title}", ""] + [f"- {_md_escape(item)}" for item in items] + [""]
    if not errors:
        lines += ["No errors.", ""]
    return "\n".join(lines)


def render_html(report: Mapping[str, Any], plot_png: bytes | None = None) -> str:
    """One self-contained page (the plot inlined), safe to mail or attach."""
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(headline(report))}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
        "table{border-collapse:collapse;margin-bottom:1.5em}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}"
        "td:not(:first-child){font-variant-numeric:tabular-nums}"
        ".failed{color:#b00}.ok{color:#070}img{max-width:100%}</style>",
        "</head><body>",
        f'<h1 class="{"ok" if report.get("ok") else "failed"}">{e(headline(report))}</h1>',
        "<ul>",
        *(f"<li><b>{e(name)}</b>: {e(value)}</li>" for name, value in facts(report)),
        "</ul>",
    ]
    if plot_png:
        encoded = base64.b64encode(plot_png).decode()
        parts.append(f'<img alt="timeline" src="data:image/png;base64,{encoded}">')
    for table in summary_tables(report):
        parts += [f"<h2>{e(table.title)}</h2>", "<table><tr>"]
        parts += [f"<th>{e(h)}</th>" for h in table.header] + ["</tr>"]
        for row in table.rows:
            parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>")
        parts.append("</table>")
    errors, warnings = notes(report)
    for title, items in (("Errors", errors), ("Warnings", warnings)):
        if items:
            parts += [f"<h2>{title}</h2>", "<ul>", *(f"<li>{e(i)}</li>" for i in items), "</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def load_report(path: Path) -> dict[str, Any]:
    """results.json, or a records directory holding one."""
    if path.is_dir():
        path = path / "results.json"
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise click.UsageError(f"{path} does not exist") from exc
    except orjson.JSONDecodeError as exc:
        raise click.UsageError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or "pods" not in data:
        raise click.UsageError(f"{path} is not a batch report (no per-episode rows)")
    return data


def _relative(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target.absolute(), start.absolute().parent)).as_posix()


@click.command()
@click.argument("results", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the timeline (PNG): one row per episode, and the Pod start-up distribution.",
)
@click.option(
    "--summary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a shareable summary: FILE.md (Markdown) or FILE.html (one self-contained page).",
)
def report(results: Path, plot: Path | None, summary: Path | None) -> None:
    """Plot and summarise a finished batch from RESULTS.json (or its records directory).

    Without --plot or --summary, prints the Markdown summary.
    """
    data = load_report(results)
    if summary is not None and summary.suffix.lower() not in (".md", ".html", ".htm"):
        raise click.UsageError(f"--summary {summary} must end in .md or .html")
    if plot is not None:
        render_timeline(data, plot)
        click.echo(f"timeline written to {plot}", err=True)
    if summary is None:
        if plot is None:
            click.echo(render_markdown(data))
        return
    if summary.suffix.lower() == ".md":
        text = render_markdown(data, _relative(plot, summary) if plot else None)
    else:
        text = render_html(data, plot.read_bytes() if plot else None)
    summary.write_text(text)
    click.echo(f"summary written to {summary}", err=True)

"""Terminal output for clients: live progress while a batch runs, and a summary table."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollout_worker import constants as k
from trainer_stub.client import Entry, RolloutClient, Submission

METRICS = (
    "episodes",
    "successful_episodes",
    "failed_episodes",
    "lost_episodes",
    "reward_sum",
    "parallelism",
    "batch_to_all_ready_seconds",
    "pod_to_ready_p50_seconds",
    "pod_to_ready_p95_seconds",
    "pod_to_ready_max_seconds",
    "batch_to_all_rewards_seconds",
    "job_complete_seconds",
    "client_job_complete_seconds",
)


class Progress:
    """Counts per batch, updated as stream entries arrive."""

    def __init__(self, batches: dict[str, int]) -> None:
        self.totals = dict(batches)
        self.counts = {b: {"ok": 0, "failed": 0, "lost": 0, "rewards": 0} for b in batches}
        self.status: dict[str, str] = {b: "running" for b in batches}

    def update(self, batch_id: str, entry: Entry) -> None:
        if entry.type == k.ENTRY_EPISODE and entry.row is not None:
            counts = self.counts[batch_id]
            counts[entry.row.get("status", "failed")] = counts.get(entry.row["status"], 0) + 1
            counts["rewards"] += int(entry.row.get("reward") or 0)
        elif entry.type == k.ENTRY_REPORT:
            self.status[batch_id] = entry.status or "reported"

    def table(self) -> Table:
        table = Table(title="rollout progress", expand=False)
        for column in ("batch", "collected", "ok", "failed", "lost", "reward_sum", "status"):
            table.add_column(column, justify="right" if column != "batch" else "left")
        for batch_id, total in self.totals.items():
            c = self.counts[batch_id]
            done = c["ok"] + c["failed"] + c["lost"]
            table.add_row(
                batch_id,
                f"{done}/{total}",
                str(c["ok"]),
                str(c["failed"]),
                str(c["lost"]),
                str(c["rewards"]),
                self.status[batch_id],
            )
        return table


def follow(
    client: RolloutClient,
    submissions: Iterable[Submission],
    console: Console,
    timeout: float | None,
    heartbeat: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Wait for every batch's report, redrawing the progress table as entries arrive.

    Adds `client_job_complete_seconds` (submit -> report seen here) to each report.
    """
    started = {s.batch_id: s for s in submissions}
    batches = {b: int(s.spec["count"]) for b, s in started.items()}
    progress = Progress(batches)
    reports: dict[str, dict[str, Any]] = {}
    with Live(
        progress.table(), console=console, refresh_per_second=8, transient=not console.is_terminal
    ) as live:
        for batch_id, entry in client.entries(list(batches), timeout, heartbeat):
            progress.update(batch_id, entry)
            if entry.type == k.ENTRY_REPORT:
                report = client.report(batch_id) or {}
                report["client_job_complete_seconds"] = time.monotonic() - started[batch_id].started
                reports[batch_id] = report
            live.update(progress.table())
    if not console.is_terminal:
        console.print(progress.table())
    return reports


def summary_table(reports: Iterable[dict[str, Any]]) -> Table:
    reports = list(reports)
    table = Table(title="batch report")
    table.add_column("metric")
    for report in reports:
        table.add_column(str(report.get("batch_id")), justify="right")
    for name in ("status", *METRICS):
        cells = []
        for report in reports:
            value = report.get(name)
            cells.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        table.add_row(name, *cells)
    return table


def print_errors(console: Console, report: dict[str, Any], limit: int = 20) -> None:
    errors = report.get("errors") or []
    for error in errors[:limit]:
        console.print(f"[red]error[/red] {error}", highlight=False)
    if len(errors) > limit:
        console.print(f"... and {len(errors) - limit} more errors (see results.json)")

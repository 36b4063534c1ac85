"""Terminal output for clients: live progress while a batch runs, and a summary table."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollout_wire import constants as k
from rollout_wire.codec import Entry
from rollout_wire.rows import REPORT_METRICS
from rollout_wire.states import EpisodeStatus, Progress
from trainer_stub.client import RolloutClient, Submission

COLUMNS = (*Progress, *EpisodeStatus)


class BatchProgress:
    """Per batch, where each episode is: pending -> running -> ready -> rewarded, then its
    collected outcome (ok, failed, lost, aborted, stale); and how many of its groups are
    complete. Updated as stream entries arrive."""

    def __init__(self, batches: dict[str, int], groups: dict[str, int] | None = None) -> None:
        self.totals = dict(batches)
        self.groups = dict(groups or {})
        self.groups_done: dict[str, int] = dict.fromkeys(batches, 0)
        self.where: dict[str, dict[int, str]] = {b: {} for b in batches}
        self.rewards: dict[str, float] = dict.fromkeys(batches, 0.0)
        self.status: dict[str, str] = dict.fromkeys(batches, Progress.RUNNING)

    def update(self, batch_id: str, entry: Entry) -> None:
        where = self.where[batch_id]
        if entry.type == k.ENTRY_STATE and entry.index is not None and entry.status:
            current = where.get(entry.index, Progress.PENDING)
            if current in k.STATES and k.STATES.index(entry.status) > k.STATES.index(current):
                where[entry.index] = entry.status
        elif entry.type == k.ENTRY_EPISODE and entry.row is not None and entry.index is not None:
            where[entry.index] = entry.row.get("status", EpisodeStatus.FAILED)
            self.rewards[batch_id] += float(entry.row.get("reward") or 0)
        elif entry.type == k.ENTRY_GROUP:
            self.groups_done[batch_id] += 1
        elif entry.type == k.ENTRY_REPORT:
            self.status[batch_id] = entry.status or "reported"

    def counts(self, batch_id: str) -> dict[str, int]:
        counts = dict.fromkeys(COLUMNS, 0)
        for state in self.where[batch_id].values():
            counts[state] = counts.get(state, 0) + 1
        counts[Progress.PENDING] = self.totals[batch_id] - sum(
            v for name, v in counts.items() if name != Progress.PENDING
        )
        return counts

    def line(self, batch_id: str) -> str:
        """One plain line, for logs and captured terminals."""
        counts = self.counts(batch_id)
        parts = " ".join(f"{name}={counts[name]}" for name in COLUMNS)
        return (
            f"batch {batch_id}: {parts} groups={self.groups_of(batch_id)} "
            f"reward_sum={self.rewards[batch_id]:g}"
        )

    def groups_of(self, batch_id: str) -> str:
        """Groups complete / groups ("-" for a batch without tasks)."""
        total = self.groups.get(batch_id, 0)
        return f"{self.groups_done[batch_id]}/{total}" if total else "-"

    def table(self) -> Table:
        table = Table(title="rollout progress", expand=False)
        table.add_column("batch")
        for column in (*COLUMNS, "groups", "reward_sum", "status"):
            table.add_column(column, justify="right")
        for batch_id in self.totals:
            counts = self.counts(batch_id)
            table.add_row(
                batch_id,
                *(str(counts[c]) for c in COLUMNS),
                self.groups_of(batch_id),
                f"{self.rewards[batch_id]:g}",
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
    """Wait for every batch's report, redrawing the progress table as entries arrive; each
    submission learns when its report was seen here (`submit_to_report_seconds`)."""
    started = {s.batch_id: s for s in submissions}
    batches = {b: s.spec.count for b, s in started.items()}
    progress = BatchProgress(batches, {b: len(s.spec.tasks) for b, s in started.items()})
    reports: dict[str, dict[str, Any]] = {}
    # A terminal gets a live table; a pipe or log gets a plain line per batch every second.
    live = (
        Live(progress.table(), console=console, refresh_per_second=8)
        if console.is_terminal
        else None
    )
    printed = dict.fromkeys(batches, "")
    last_print = 0.0
    with live or contextlib.nullcontext():
        for batch_id, entry in client.entries(list(batches), timeout, heartbeat):
            progress.update(batch_id, entry)
            if entry.type == k.ENTRY_REPORT:
                started[batch_id].saw_report()
                reports[batch_id] = client.report(batch_id) or {}
            if live is not None:
                live.update(progress.table())
            elif entry.type == k.ENTRY_REPORT or time.monotonic() - last_print >= 1.0:
                last_print = time.monotonic()
                for name in batches:
                    line = progress.line(name)
                    if line != printed[name]:
                        console.print(line, highlight=False)
                        printed[name] = line
    return reports


def summary_table(
    reports: Iterable[dict[str, Any]], submissions: Iterable[Submission] = ()
) -> Table:
    """The headline metrics per batch, and this client's submit -> report time."""
    reports = list(reports)
    seen = {s.batch_id: s.submit_to_report_seconds for s in submissions}
    table = Table(title="batch report")
    table.add_column("metric")
    for report in reports:
        table.add_column(str(report.get("batch_id")), justify="right")
    rows = [(name, [r.get(name) for r in reports]) for name in ("status", *REPORT_METRICS)]
    rows.append(
        ("client_submit_to_report_seconds", [seen.get(r.get("batch_id", "")) for r in reports])
    )
    for name, values in rows:
        table.add_row(name, *(f"{v:.3f}" if isinstance(v, float) else str(v) for v in values))
    return table


GROUP_COLUMNS = ("task", "rewards", "mean", "pass@1", "pass@k", "status", "no sample")


def group_table(report: dict[str, Any], title: str | None = None) -> Table:
    """Each group of a report: rewards, mean, pass@1 and the largest k, status (`counted`
    when it made the quota), and how many of its episodes are no sample, by kind (an
    infrastructure or episode failure, aborted, stale)."""
    batch = report.get("batch_id")
    table = Table(title=title or f"groups of batch {batch} (group id = {batch}:<task>)")
    quota = report.get("quota") or {}
    counted = set(quota.get("counted") or ())
    for column in GROUP_COLUMNS:
        table.add_column(column, no_wrap=column != "rewards")
    for group in report.get("groups", []):
        table.add_row(*group_cells(group, group["group_id"] in counted if quota else None))
    return table


def group_cells(group: dict[str, Any], counted: bool | None = None) -> list[str]:
    passes = group.get("pass_at_k") or {}
    top = max(passes, key=int) if passes else None

    def num(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"

    # A group that made the quota is complete by definition: "counted" says both.
    status = "counted" if counted or group.get("counted") else str(group.get("status"))
    kinds = [str(f["failure_kind"]) for f in group.get("failed", [])]
    kinds += [str(w["status"]) for w in group.get("withdrawn", [])]
    others = [f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds)]
    return [
        str(group.get("task_id")),
        " ".join(f"{r:g}" for r in group.get("rewards", [])),
        num(group.get("mean")),
        num(passes.get("1")),
        f"{num(passes[top])} k={top}" if top else "-",
        status,
        ", ".join(others),
    ]


def print_errors(console: Console, report: dict[str, Any], limit: int = 20) -> None:
    errors = report.get("errors") or []
    for error in errors[:limit]:
        console.print(f"[red]error[/red] {error}", highlight=False)
    if len(errors) > limit:
        console.print(f"... and {len(errors) - limit} more errors (see results.json)")

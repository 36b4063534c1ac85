"""A batch's timeline as a picture, from its report (results.json).

`episode_timelines`, `startup_seconds`, `busy_spans` and `episode_cpu` are pure: they turn the
report into seconds since the run started (and CPU-seconds per episode). `render_timeline` draws
them (matplotlib, Agg, no pyplot state) into a PNG: one row per episode (created, scheduled when
known, ready, reward, finished; failed episodes in red); under it, on the same time axis, the
slots busy with episode work against the parallelism, the idle part shaded; then the
distribution of Pod-created-to-ready times with p50/p95 marked, and where the CPU went (the
cost ledger's CPU-seconds per episode, user and system).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from rollout_wire.states import EpisodeStatus
from rollout_worker.metrics import busy_slots, busy_span, percentile

# More rows than this and per-row tick labels become noise.
MAX_LABELLED_ROWS = 40
# More rows than this and point markers hide the segments: draw segments (and failures) only.
MAX_MARKED_ROWS = 80
COLORS = {
    "startup": "#9ecae1",  # created -> ready
    "work": "#3182bd",  # ready -> reward
    "tail": "#bdbdbd",  # reward -> finished
    "failed": "#d62728",
    "created": "#525252",
    "scheduled": "#756bb1",
    "ready": "#31a354",
    "reward": "#fd8d3c",
    "busy": "#3182bd",
    "idle": "#fdd0a2",
    "cpu_user": "#6baed6",
    "cpu_system": "#08519c",
}


@dataclass(frozen=True)
class EpisodeTimeline:
    """One episode's moments, in seconds since the run started (None when not known)."""

    index: int
    pod: str
    status: str
    created: float | None
    scheduled: float | None
    ready: float | None
    reward: float | None
    finished: float | None

    @property
    def failed(self) -> bool:
        return self.status != EpisodeStatus.OK

    @property
    def end(self) -> float | None:
        known = [t for t in (self.finished, self.reward, self.ready, self.created) if t is not None]
        return max(known) if known else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def run_origin(report: Mapping[str, Any]) -> float | None:
    """The run's start (time zero of the plot): run_created_at, else the earliest Pod."""
    origin = _number(report.get("run_created_at"))
    if origin is not None:
        return origin
    created = [_number(row.get("created_at")) for row in report.get("pods") or []]
    known = [t for t in created if t is not None]
    return min(known) if known else _number(report.get("submitted_at"))


def episode_timelines(report: Mapping[str, Any]) -> list[EpisodeTimeline]:
    origin = run_origin(report)

    def since(value: Any) -> float | None:
        moment = _number(value)
        return None if moment is None or origin is None else moment - origin

    rows = sorted(report.get("pods") or [], key=lambda row: int(row.get("index", 0)))
    return [
        EpisodeTimeline(
            index=int(row.get("index", 0)),
            pod=str(row.get("pod", "")),
            status=str(row.get("status", EpisodeStatus.FAILED)),
            created=since(row.get("created_at")),
            scheduled=since((row.get("timing") or {}).get("scheduled_at")),
            ready=since(row.get("ready_at")),
            reward=since(row.get("reward_at")),
            finished=since(row.get("finished_at")),
        )
        for row in rows
    ]


def startup_seconds(report: Mapping[str, Any]) -> list[float]:
    """Pod created -> ready, per episode that got ready."""
    values = []
    for row in report.get("pods") or []:
        value = _number(row.get("pod_to_ready_seconds"))
        if value is None:
            created, ready = _number(row.get("created_at")), _number(row.get("ready_at"))
            value = ready - created if created is not None and ready is not None else None
        if value is not None:
            values.append(value)
    return values


def busy_spans(report: Mapping[str, Any]) -> list[tuple[float, float]]:
    """Each episode's busy span (ready -> finished, as the report's slot_utilisation counts
    it: metrics.busy_span), in seconds since the run started."""
    origin = run_origin(report)
    if origin is None:
        return []
    spans = []
    for row in report.get("pods") or []:
        span = busy_span(
            _number(row.get("ready_at")),
            _number(row.get("finished_at")),
            _number(row.get("collected_at")),
            _number(row.get("reward_at")),
        )
        if span is not None:
            spans.append((span[0] - origin, span[1] - origin))
    return spans


@dataclass(frozen=True)
class EpisodeCpu:
    """One episode's CPU-seconds from its cost ledger (user and system when known)."""

    index: int
    total: float
    user: float | None
    system: float | None
    failed: bool


def episode_cpu(report: Mapping[str, Any]) -> list[EpisodeCpu]:
    """The episodes whose ledger has CPU-seconds, in index order."""
    found = []
    for row in report.get("pods") or []:
        cost = row.get("cost") if isinstance(row.get("cost"), Mapping) else {}
        total = _number(cost.get("cpu_seconds"))
        if total is None:
            continue
        found.append(
            EpisodeCpu(
                index=int(row.get("index", 0)),
                total=total,
                user=_number(cost.get("cpu_user_seconds")),
                system=_number(cost.get("cpu_system_seconds")),
                failed=row.get("status") != EpisodeStatus.OK,
            )
        )
    return sorted(found, key=lambda e: e.index)


def title(report: Mapping[str, Any]) -> str:
    return (
        f"batch {report.get('batch_id', '?')} ({report.get('backend', '?')} backend): "
        f"{report.get('successful_episodes', 0)}/{report.get('episodes', 0)} ok, "
        f"reward_sum {report.get('reward_sum', 0)}, parallelism {report.get('parallelism', '?')}"
    )


def _segment(ax: Any, y: float, start: float | None, stop: float | None, **style: Any) -> None:
    if start is not None and stop is not None and stop >= start:
        ax.hlines(y, start, stop, **style)


def _draw_timeline(ax: Any, episodes: Sequence[EpisodeTimeline], report: Mapping[str, Any]) -> None:
    """One row per episode: its phases as bars, its moments as markers, the batch's moments as
    vertical lines; a legend of what is drawn."""
    n = len(episodes)
    marker = max(2.0, min(7.0, 240 / max(n, 1)))
    _draw_phases(ax, episodes)
    marked = n <= MAX_MARKED_ROWS  # past that many rows the markers only hide the bars
    if marked:
        _draw_moments(ax, episodes, marker)
    _draw_failures(ax, episodes, marker)
    marks = _draw_batch_moments(ax, report)
    ax.set_ylim(n - 0.5, -0.5)  # episode 0 on top
    if n <= MAX_LABELLED_ROWS:
        ax.set_yticks(range(n), [str(e.index) for e in episodes], fontsize=7)
    ax.set_ylabel("episode (index)")
    ax.set_xlabel("seconds since run start")
    ax.set_xlim(left=min([0.0, *(e.created for e in episodes if e.created is not None)]))
    ax.grid(axis="x", alpha=0.3)
    legend = _timeline_legend(episodes, marked)
    ax.legend(handles=legend + marks, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _draw_phases(ax: Any, episodes: Sequence[EpisodeTimeline]) -> None:
    """Each episode's bar: startup, work and tail, or one failed bar."""
    height = max(1.0, min(8.0, 200 / max(len(episodes), 1)))  # segment thickness in points
    for row, ep in enumerate(episodes):
        if ep.failed:
            _segment(ax, row, ep.created, ep.end, colors=COLORS["failed"], linewidth=height)
        else:
            _segment(ax, row, ep.created, ep.ready, colors=COLORS["startup"], linewidth=height)
            _segment(ax, row, ep.ready, ep.reward, colors=COLORS["work"], linewidth=height)
            _segment(ax, row, ep.reward, ep.finished, colors=COLORS["tail"], linewidth=height)


def _draw_moments(ax: Any, episodes: Sequence[EpisodeTimeline], marker: float) -> None:
    """A marker per episode moment: created, scheduled, ready, reward."""
    points: list[tuple[str, str, Callable[[EpisodeTimeline], float | None]]] = [
        ("created", "|", lambda e: e.created),
        ("scheduled", "s", lambda e: e.scheduled),
        ("ready", "o", lambda e: e.ready),
        ("reward", "D", lambda e: e.reward),
    ]
    for name, shape, pick in points:
        xs = [(x, row) for row, e in enumerate(episodes) if (x := pick(e)) is not None]
        if xs:
            ax.plot(
                [x for x, _ in xs],
                [y for _, y in xs],
                linestyle="none",
                marker=shape,
                markersize=marker * (1.6 if shape == "|" else 1.0),
                color=COLORS[name],
                zorder=3,
            )


def _draw_failures(ax: Any, episodes: Sequence[EpisodeTimeline], marker: float) -> None:
    """An X where a failed or lost episode ended."""
    failed = [(e.end, row) for row, e in enumerate(episodes) if e.failed and e.end is not None]
    if failed:
        ax.plot(
            [x for x, _ in failed],
            [y for _, y in failed],
            linestyle="none",
            marker="X",
            markersize=max(6.0, marker * 1.4),
            color=COLORS["failed"],
            zorder=4,
        )


def _draw_batch_moments(ax: Any, report: Mapping[str, Any]) -> list[Line2D]:
    """The batch's own moments (all ready, all rewards) as vertical lines; their legend keys."""
    marks = []
    moments: tuple[tuple[str, str, Literal[":", "--"]], ...] = (
        ("batch_to_all_ready_seconds", "all ready", ":"),
        ("batch_to_all_rewards_seconds", "all rewards", "--"),
    )
    for key, label, style in moments:
        value = _number(report.get(key))
        if value is not None:
            ax.axvline(value, color="#636363", linestyle=style, linewidth=1)
            marks.append(
                Line2D([], [], color="#636363", linestyle=style, label=f"{label} {value:.2f}s")
            )
    return marks


def _timeline_legend(episodes: Sequence[EpisodeTimeline], marked: bool) -> list[Line2D]:
    """The legend keys of the bars, and of the markers when they were drawn."""
    legend = [
        Line2D([], [], color=COLORS["startup"], linewidth=6, label="created → ready"),
        Line2D([], [], color=COLORS["work"], linewidth=6, label="ready → reward"),
        Line2D([], [], color=COLORS["tail"], linewidth=6, label="reward → finished"),
        Line2D(
            [], [], color=COLORS["failed"], marker="X", linewidth=3, label="failed / lost episode"
        ),
    ]
    if marked:
        legend[3:3] = [
            Line2D([], [], color=COLORS["created"], marker="|", linestyle="none", label="created"),
            Line2D([], [], color=COLORS["ready"], marker="o", linestyle="none", label="ready"),
            Line2D([], [], color=COLORS["reward"], marker="D", linestyle="none", label="reward"),
        ]
    if marked and any(e.scheduled is not None for e in episodes):
        legend.insert(
            4,
            Line2D(
                [], [], color=COLORS["scheduled"], marker="s", linestyle="none", label="scheduled"
            ),
        )
    return legend


def _draw_startup(ax: Any, startup: Sequence[float]) -> None:
    ax.set_title(f"Pod created → ready ({len(startup)} episodes)", fontsize=10)
    ax.set_xlabel("seconds")
    ax.set_ylabel("episodes")
    if not startup:
        ax.text(
            0.5, 0.5, "no episode became ready", ha="center", va="center", transform=ax.transAxes
        )
        return
    bins = max(5, min(40, round(math.sqrt(len(startup)) * 2)))
    ax.hist(startup, bins=bins, color=COLORS["startup"], edgecolor="#3182bd")
    for q, style in ((0.5, "-"), (0.95, "--")):
        value = percentile(startup, q)
        ax.axvline(
            value,
            color="#08519c",
            linestyle=style,
            linewidth=1.5,
            label=f"p{round(q * 100)} {value:.3f}s",
        )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _draw_slots(ax: Any, spans: Sequence[tuple[float, float]], report: Mapping[str, Any]) -> None:
    parallelism = _number(report.get("parallelism"))
    utilisation = _number(report.get("slot_utilisation"))
    shown = f" (slot_utilisation {utilisation:.2f})" if utilisation is not None else ""
    ax.set_title(f"slots busy with episode work (ready → finished){shown}", fontsize=10)
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("slots")
    steps = [(0.0, 0), *busy_slots(spans)] if spans else []
    if not steps:
        ax.text(
            0.5, 0.5, "no episode became ready", ha="center", va="center", transform=ax.transAxes
        )
        return
    xs, ys = [x for x, _ in steps], [y for _, y in steps]
    ax.step(xs, ys, where="post", color=COLORS["busy"], linewidth=1.5, label="busy")
    if parallelism:
        ax.axhline(parallelism, color="#636363", linestyle="--", linewidth=1, label="parallelism")
        ax.fill_between(
            xs, ys, parallelism, step="post", color=COLORS["idle"], alpha=0.7, label="idle slots"
        )
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _draw_cpu(ax: Any, cpu: Sequence[EpisodeCpu]) -> None:
    total = sum(e.total for e in cpu)
    ax.set_title(f"where the CPU went: {total:.1f} CPU-s over {len(cpu)} episodes", fontsize=10)
    ax.set_xlabel("episode (index)")
    ax.set_ylabel("CPU-seconds")
    if not cpu:
        ax.text(
            0.5,
            0.5,
            "no cost ledger in this report",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return
    xs = [e.index for e in cpu]
    # Split into user and system where the ledger says; else the whole bar is user's colour.
    users = [e.user if e.user is not None and e.system is not None else e.total for e in cpu]
    systems = [e.system if e.user is not None and e.system is not None else 0.0 for e in cpu]
    edges = [COLORS["failed"] if e.failed else "none" for e in cpu]
    ax.bar(xs, users, color=COLORS["cpu_user"], edgecolor=edges, label="user")
    ax.bar(xs, systems, bottom=users, color=COLORS["cpu_system"], edgecolor=edges, label="system")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def render_timeline(report: Mapping[str, Any], path: Path, *, dpi: int = 120) -> Path:
    """Write the PNG (timeline, busy slots, start-up, CPU) and return its path."""
    episodes = episode_timelines(report)
    rows = len(episodes)
    timeline_height = max(2.5, min(12.0, 0.22 * rows + 1.5))
    fig = Figure(figsize=(12, timeline_height + 5.0), layout="constrained")
    panels = fig.subplot_mosaic(
        [["timeline", "timeline"], ["slots", "slots"], ["startup", "cpu"]],
        height_ratios=[timeline_height, 1.8, 2.6],
    )
    timeline, startup = panels["timeline"], panels["startup"]
    panels["slots"].sharex(timeline)
    fig.suptitle(title(report), fontsize=12)
    timeline.set_title(f"episode timeline ({rows} episodes)", fontsize=10)
    if episodes:
        _draw_timeline(timeline, episodes, report)
    else:
        timeline.text(
            0.5,
            0.5,
            "the report has no episode rows",
            ha="center",
            va="center",
            transform=timeline.transAxes,
        )
    spans = busy_spans(report)
    _draw_slots(panels["slots"], spans, report)
    if spans:
        # The shared time axis reaches the last episode's end, whatever the timeline drew.
        left, right = timeline.get_xlim()
        timeline.set_xlim(left, max(right, max(stop for _, stop in spans) * 1.02))
    _draw_startup(startup, startup_seconds(report))
    _draw_cpu(panels["cpu"], episode_cpu(report))
    fig.savefig(path, dpi=dpi, format="png")
    return path

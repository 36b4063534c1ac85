"""`rollout tasks check`: what it submits and how it judges the rows (pure: no I/O).

A task set passes when every task's oracle (its solution/solve.sh) scores 1 and, with --nop, an
agent that does nothing scores 0 (tests that pass untouched reward nothing learned). The click
command (`rollout_worker.cli.tasks.check`) builds, submits the two batches and prints what the
functions here make of the reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_wire.request import DEFAULT_EPISODE_TIMEOUT_SECONDS, DEFAULT_TASK_TIME_LIMIT_SECONDS

# The agent that does nothing: it exits 0 at once, leaving the workspace as the task gave it.
NOP_AGENT: dict[str, Any] = {"command": ["true"]}
# A batch with a command agent must name a policy; neither the oracle nor the nop asks it
# (port 9 is discard: nothing listens).
NEVER_ASKED_POLICY = {"url": "http://127.0.0.1:9"}
# Set-up and grading on top of a task's own time limit, per episode.
EPISODE_MARGIN_SECONDS = 60
# The batch's deadline on top of its longest episode (every episode runs at once).
DEADLINE_MARGIN_SECONDS = 120

# Exit statuses (2 is click's usage error).
EXIT_OK = 0
EXIT_FAILED = 1  # a task failed the check: an oracle below 1, a nop above 0, no oracle
EXIT_INCOMPLETE = 3  # no task failed, but some episodes failed for infrastructure: run again


@dataclass(frozen=True)
class Outcome:
    """What one episode of the check gave: its reward (None: no usable reward, the episode
    failed or was lost), its seconds, what the row says about it, and whether the failure was
    the infrastructure's (the task was not judged) rather than the episode's."""

    reward: float | None
    seconds: float | None
    detail: str | None = None
    infrastructure: bool = False
    said: str | None = None  # the agent's last line of output: why a wrong oracle is wrong


# What a cause quotes of an agent's output, and of a build's failure.
SAID_CHARS = 80
BUILD_ERROR_CHARS = 160


@dataclass(frozen=True)
class TaskCheck:
    """One task's line: its oracle and nop outcomes (None: not run), or why none ran."""

    task_id: str
    has_oracle: bool
    oracle: Outcome | None = None
    nop: Outcome | None = None
    build_error: str | None = None  # its image could not be built: nothing ran


def limits(tasks: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(episode timeout, batch deadline) that fit the longest task's own limit."""
    longest = max(
        (int(t.get("time_limit_seconds", DEFAULT_TASK_TIME_LIMIT_SECONDS)) for t in tasks),
        default=DEFAULT_TASK_TIME_LIMIT_SECONDS,
    )
    episode = max(DEFAULT_EPISODE_TIMEOUT_SECONDS, longest + EPISODE_MARGIN_SECONDS)
    return episode, episode + DEADLINE_MARGIN_SECONDS


def resources(requirements: Sequence[Mapping[str, int]]) -> dict[str, str]:
    """The batch's limits from what the tasks state ([environment] cpus, memory_mb, storage_mb, as
    `rollout_wire.harbor` maps them): the largest of each, as `rollout run --tasks` takes them
    without a flag, so every task is judged under the limits it asks for; {} when none states
    any (the batch's defaults stand)."""
    from rollout_worker.quantities import format_memory

    cpus = max((r.get("cpus", 0) for r in requirements), default=0)
    memory_mb = max((r.get("memory_mb", 0) for r in requirements), default=0)
    storage_mb = max((r.get("storage_mb", 0) for r in requirements), default=0)
    found = {}
    if cpus:
        found["cpu_limit"] = str(cpus)
    if memory_mb:
        found["memory_limit"] = format_memory(memory_mb * 2**20)
    if storage_mb:
        found["storage_limit"] = format_memory(storage_mb * 2**20)
    return found


def has_solution(task: Mapping[str, Any]) -> bool:
    """Whether the oracle can run: the task's solve.sh, or for a task with steps each step's
    (the oracle runs every step's own, and refuses a task where one lacks it)."""
    steps = task.get("steps")
    if steps:
        return all("solve.sh" in (step.get("solution") or {}) for step in steps)
    return "solve.sh" in (task.get("solution") or {})


def oracle_tasks(tasks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(t) | {"agent": "oracle"} for t in tasks if has_solution(t)]


def nop_tasks(tasks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(t) | {"agent": NOP_AGENT} for t in tasks]


def _seconds(row: Mapping[str, Any]) -> float | None:
    start, end = row.get("created_at"), row.get("finished_at")
    if isinstance(start, int | float) and isinstance(end, int | float) and end >= start:
        return float(end - start)
    return None


def outcome(row: Mapping[str, Any] | None, report: Mapping[str, Any]) -> Outcome:
    """One episode row (None: the report has none for the task) as the check reads it."""
    if row is None:
        errors = report.get("errors") or []
        why = errors[0] if errors else f"batch {report.get('status', 'unknown')}"
        return Outcome(None, None, f"no episode ran ({why})", infrastructure=True)
    seconds = _seconds(row)
    status = str(row.get("status"))
    if status != "ok":
        cause = row.get("failure_cause") or "; ".join(row.get("errors") or []) or status
        infra = row.get("failure_kind") == "infrastructure" or status == "lost"
        return Outcome(None, seconds, f"{status}: {cause}", infrastructure=infra)
    notes = []
    if row.get("grade_cause"):
        notes.append(str(row["grade_cause"]))
    code = row.get("agent_exit_code")
    if code is None and row.get("stop_reason") == "time_limit":
        notes.append("agent timed out")
    elif code not in (0, None):
        notes.append(f"agent exited {code}")
    lines = [line.strip() for line in str(row.get("agent_output") or "").splitlines()]
    said = next((line for line in reversed(lines) if line), None)
    if said is not None and len(said) > SAID_CHARS:
        said = said[: SAID_CHARS - 3] + "..."
    return Outcome(float(row.get("reward") or 0), seconds, ", ".join(notes) or None, said=said)


def rows_by_task(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {str(r.get("task_id")): r for r in report.get("pods") or []}


def collect(
    tasks: Sequence[Mapping[str, Any]],
    oracle_report: Mapping[str, Any] | None,
    nop_report: Mapping[str, Any] | None,
    build_errors: Mapping[str, str],
) -> list[TaskCheck]:
    """Every task's line, in the task set's order, from the two reports (None: not run)."""
    oracle_rows = rows_by_task(oracle_report or {})
    nop_rows = rows_by_task(nop_report or {})
    checks = []
    for task in tasks:
        tid = str(task["id"])
        if tid in build_errors:
            checks.append(TaskCheck(tid, has_solution(task), build_error=build_errors[tid]))
            continue
        oracle = None
        if has_solution(task) and oracle_report is not None:
            oracle = outcome(oracle_rows.get(tid), oracle_report)
        nop = outcome(nop_rows.get(tid), nop_report) if nop_report is not None else None
        checks.append(TaskCheck(tid, has_solution(task), oracle, nop))
    return checks


def _number(value: float) -> str:
    return f"{value:g}"


def _failed(who: str, result: Outcome) -> str:
    kind = "infrastructure" if result.infrastructure else "failed"
    return f"{who} {kind}: {result.detail}"


def problems(check: TaskCheck, *, allow_no_oracle: bool = False) -> list[str]:
    """Why the task fails the check (empty: it passes)."""
    if check.build_error is not None:
        # Its first line (the whole message, with how to provide a base image, is printed
        # above the table).
        first = check.build_error.splitlines()[0] if check.build_error else "?"
        if len(first) > BUILD_ERROR_CHARS:
            first = first[: BUILD_ERROR_CHARS - 3] + "..."
        return [f"build failed: {first}"]
    found = []
    if not check.has_oracle:
        if not allow_no_oracle:
            found.append("no oracle: no solution/solve.sh to prove the task solvable")
    elif (oracle := check.oracle) is not None:
        if oracle.reward is None:
            found.append(_failed("oracle", oracle))
        elif oracle.reward < 1:
            why = f" ({oracle.detail})" if oracle.detail else ""
            said = f"; solve.sh's last line: {oracle.said!r}" if oracle.said else ""
            found.append(f"oracle scored {_number(oracle.reward)}{why}{said}")
    if (nop := check.nop) is not None:
        if nop.reward is None:
            found.append(_failed("nop", nop))
        elif nop.reward > 0:
            found.append(f"nop scored {_number(nop.reward)}: the tests reward an untouched task")
    return found


def infrastructure_only(check: TaskCheck, *, allow_no_oracle: bool = False) -> bool:
    """Whether the task's only problems are episodes the infrastructure failed (the task
    itself was not judged): its problems without those episodes are none."""
    if check.build_error is not None or not problems(check, allow_no_oracle=allow_no_oracle):
        return False
    oracle, nop = check.oracle, check.nop
    if not any(r is not None and r.infrastructure for r in (oracle, nop)):
        return False
    judged = TaskCheck(
        check.task_id,
        check.has_oracle,
        None if oracle is not None and oracle.infrastructure else oracle,
        None if nop is not None and nop.infrastructure else nop,
    )
    return not problems(judged, allow_no_oracle=allow_no_oracle)


def _cell(result: Outcome | None, *, ran: bool, missing: str) -> str:
    if not ran:
        return "-"
    if result is None:
        return missing
    if result.reward is None:
        return "infra" if result.infrastructure else "failed"
    return _number(result.reward)


def table(
    checks: Sequence[TaskCheck], *, nop: bool, allow_no_oracle: bool = False
) -> list[list[str]]:
    """The rows to print: task, oracle reward, nop reward, seconds, verdict and cause."""
    rows = [["TASK", "ORACLE", "NOP", "SECONDS", "RESULT", "CAUSE"]]
    for check in checks:
        found = problems(check, allow_no_oracle=allow_no_oracle)
        if check.build_error is not None:
            oracle_cell, nop_cell = "not built", "not built" if nop else "-"
        else:
            oracle_cell = _cell(check.oracle, ran=True, missing="no oracle")
            nop_cell = _cell(check.nop, ran=nop, missing="-")
        times = [r.seconds for r in (check.oracle, check.nop) if r and r.seconds is not None]
        seconds = f"{max(times):.1f}" if times else "-"
        if not found:
            verdict = "ok"
        elif infrastructure_only(check, allow_no_oracle=allow_no_oracle):
            verdict = "INCOMPLETE"
        else:
            verdict = "FAIL"
        rows.append([check.task_id, oracle_cell, nop_cell, seconds, verdict, "; ".join(found)])
    return rows


def exit_status(checks: Sequence[TaskCheck], *, allow_no_oracle: bool = False) -> int:
    """EXIT_FAILED when a task failed the check, else EXIT_INCOMPLETE when an episode failed for
    infrastructure (the task was not judged), else EXIT_OK."""
    failing = [c for c in checks if problems(c, allow_no_oracle=allow_no_oracle)]
    if any(not infrastructure_only(c, allow_no_oracle=allow_no_oracle) for c in failing):
        return EXIT_FAILED
    return EXIT_INCOMPLETE if failing else EXIT_OK


def summary(checks: Sequence[TaskCheck], *, allow_no_oracle: bool = False) -> str:
    """The closing line: how many passed, which failed, which could not be judged."""
    failed = [
        c.task_id
        for c in checks
        if problems(c, allow_no_oracle=allow_no_oracle)
        and not infrastructure_only(c, allow_no_oracle=allow_no_oracle)
    ]
    incomplete = [
        c.task_id for c in checks if infrastructure_only(c, allow_no_oracle=allow_no_oracle)
    ]
    passed = len(checks) - len(failed) - len(incomplete)
    plural = "" if len(checks) == 1 else "s"
    text = f"{len(checks)} task{plural}: {passed} passed"
    if failed:
        text += f", {len(failed)} failed ({', '.join(failed)})"
    if incomplete:
        text += (
            f", {len(incomplete)} not judged: an episode failed for infrastructure "
            f"({', '.join(incomplete)}); run the check again"
        )
    return text

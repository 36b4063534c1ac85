"""A task's artifacts the runner refused to read (a link, a FIFO, too large, too many): the
reward event's `artifacts_refused` ("path: why") checked and kept on the row, so the report
can say which episodes lost an artifact instead of leaving it to the episode's log."""

from __future__ import annotations

from typing import Any

from rollout_wire.rows import MAX_ARTIFACT_REFUSAL_CHARS, MAX_ARTIFACT_REFUSALS, EpisodeRow


def artifacts_refused(row: EpisodeRow, reward: dict[str, Any], errors: list[str]) -> None:
    """The row's artifacts_refused: None when the task listed no artifacts (the runner then
    reports none), else the runner's list, bounded as the runner bounds it."""
    refused = reward.get("artifacts_refused")
    if refused is None:
        return
    if (
        not isinstance(refused, list)
        or len(refused) > MAX_ARTIFACT_REFUSALS
        or not all(isinstance(r, str) and len(r) <= MAX_ARTIFACT_REFUSAL_CHARS for r in refused)
    ):
        errors.append(
            f"artifacts_refused is not a list of at most {MAX_ARTIFACT_REFUSALS} texts of "
            f"{MAX_ARTIFACT_REFUSAL_CHARS} characters"
        )
        return
    row.artifacts_refused = list(refused)

"""The runner's artifacts_refused (a task's artifacts it would not read) reach the row and the
report: validation keeps the list (bounded as the runner bounds it, anything else fails the
episode), and the report counts the episodes that lost an artifact and warns of them."""

from __future__ import annotations

import pytest

from rollout_wire.request import parse_spec
from rollout_wire.rows import MAX_ARTIFACT_REFUSALS, EpisodeRow
from rollout_worker.backends.base import RunHandle
from rollout_worker.report import build_report
from rollout_worker.validation import validate_episode
from tests.unit.test_agent_validation import ORIGIN, agent_log, obs


def test_the_row_keeps_what_the_runner_refused_to_read():
    refused = ["/logs/out.txt: a symbolic link (never followed)", "big.bin: above 262144 bytes"]
    row = validate_episode(obs(), agent_log(reward={"artifacts_refused": refused}), ORIGIN)
    assert row.status == "ok", row.errors
    assert row.artifacts_refused == refused
    assert EpisodeRow.from_dict(row.to_dict()).artifacts_refused == refused
    # A task without artifacts: the runner reports none, the row says so with None.
    assert validate_episode(obs(), agent_log(), ORIGIN).artifacts_refused is None
    empty = validate_episode(obs(), agent_log(reward={"artifacts_refused": []}), ORIGIN)
    assert empty.status == "ok" and empty.artifacts_refused == []


@pytest.mark.parametrize(
    "value",
    ["a: why", [1], ["x" * 1001], ["a: why"] * (MAX_ARTIFACT_REFUSALS + 1), {"a": "why"}],
)
def test_a_malformed_artifacts_refused_fails_the_episode(value):
    row = validate_episode(obs(), agent_log(reward={"artifacts_refused": value}), ORIGIN)
    assert row.status != "ok"
    assert any(e.startswith("artifacts_refused is not a list") for e in row.errors), row.errors


def test_the_report_counts_and_names_episodes_that_lost_an_artifact():
    task = {"id": "a", "statement": "s", "files": {"a.py": ""}, "test_command": ["python"]}
    spec = parse_spec(
        {"tasks": [task], "samples_per_task": 3, "policy": {"url": "http://p:1"}},
        max_episodes=100,
    )

    def row(index: int, refused: list[str] | None) -> EpisodeRow:
        e = spec.episode(index)
        return EpisodeRow(
            index=index,
            pod=f"p-{index}",
            status="ok",
            reward=1,
            task_id=e.task_id,
            sample=e.sample,
            group_id=e.group_id,
            artifacts_refused=refused,
        )

    rows = [row(0, None), row(1, ["out: a FIFO", "b: gone"]), row(2, [])]
    run = RunHandle("local", spec.batch_id, ORIGIN, "p", "local:x")
    report = build_report(spec, rows, run, None, finalized_by="chord", reported_at=ORIGIN)
    assert report["artifacts_refused_episodes"] == 1
    assert report["warnings"] == [
        "1 episode(s) had artifacts refused (episode 1: 'out: a FIFO' ...)"
    ]
    assert report["pods"][1]["artifacts_refused"] == ["out: a FIFO", "b: gone"]
    assert report["ok"]  # a lost artifact is no failed episode
    clean = build_report(spec, rows[:1], run, None, finalized_by="chord", reported_at=ORIGIN)
    assert clean["artifacts_refused_episodes"] == 0 and clean["warnings"] == []

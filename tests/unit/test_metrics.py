import pytest

from rollout_wire.request import parse_spec
from rollout_wire.rows import EpisodeRow
from rollout_worker.backends.base import FinishedRun, RunHandle
from rollout_worker.metrics import percentile
from rollout_worker.report import build_report

RUN = RunHandle(
    backend="kubernetes", batch_id="b", origin=100.0, episode_prefix="rollout", context="ctx"
)


def report_of(spec, rows, finished=None):
    return build_report(spec, rows, RUN, finished, finalized_by="chord", reported_at=120.0)


def test_percentile_interpolates_linearly():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0.5) == 2.5
    assert percentile(values, 0.95) == pytest.approx(3.85)
    assert percentile([7.0], 0.95) == 7.0
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def ok_row(index, created, ready, reward, origin=100.0):
    return EpisodeRow(
        index=index,
        pod=f"p-{index}",
        status="ok",
        reward=1,
        created_at=created,
        ready_at=ready,
        reward_at=reward,
        pod_to_ready_seconds=ready - created,
        batch_to_ready_seconds=ready - origin,
        batch_to_reward_seconds=reward - origin,
        node="n1",
        image_id="img",
    )


def test_report_metrics_match_the_guides_definitions():
    spec = parse_spec({"count": 3, "parallelism": 3}, max_episodes=10)
    rows = [
        ok_row(0, 100.5, 101.0, 103.0),
        ok_row(1, 100.5, 102.0, 104.0),
        ok_row(2, 101.0, 104.0, 109.0),
    ]
    report = report_of(spec, rows)
    assert report["ok"] is True and report["status"] == "succeeded"
    assert (report["episodes"], report["successful_episodes"], report["reward_sum"]) == (3, 3, 3)
    assert report["batch_to_all_ready_seconds"] == 4.0
    assert report["batch_to_all_rewards_seconds"] == 9.0
    assert report["pod_to_ready_p50_seconds"] == 1.5
    assert report["pod_to_ready_max_seconds"] == 3.0
    assert report["pod_to_ready_p95_seconds"] == pytest.approx(2.85)
    assert report["nodes"] == {"n1": 3}


def test_each_episode_counts_once_and_missing_ones_fail_the_batch():
    spec = parse_spec({"count": 3}, max_episodes=10)
    rows = [ok_row(0, 100, 101, 102), ok_row(0, 100, 101, 102), ok_row(1, 100, 101, 102)]
    report = report_of(spec, rows)
    assert report["reward_sum"] == 2 and report["collected_episodes"] == 2
    assert report["ok"] is False and report["lost_episodes"] == 1
    assert any("never collected" in e for e in report["errors"])


def test_a_failed_episode_is_never_hidden():
    spec = parse_spec({"count": 2}, max_episodes=10)
    bad = EpisodeRow(index=1, pod="p-1", status="failed", errors=["reward is 0, expected 1"])
    report = report_of(spec, [ok_row(0, 100, 101, 102), bad])
    assert report["ok"] is False and report["status"] == "failed"
    assert report["successful_episodes"] == 1 and report["failed_episodes"] == 1
    assert report["reward_sum"] == 1
    assert any("p-1" in e and "reward is 0" in e for e in report["errors"])


def test_a_run_that_ended_failed_fails_the_report_and_its_timing_is_reported():
    spec = parse_spec({"count": 1}, max_episodes=10)
    done = FinishedRun(completed_at=112.0, verdict="Complete", facts={"isolation": "bwrap"})
    report = report_of(spec, [ok_row(0, 100, 101, 102)], done)
    assert report["ok"] is True and report["job_complete_seconds"] == 12.0
    assert (report["context"], report["run_isolation"], report["run_verdict"]) == (
        "ctx",
        "bwrap",
        "Complete",
    )
    failed = report_of(spec, [ok_row(0, 100, 101, 102)], FinishedRun(verdict="Failed"))
    assert failed["ok"] is False and any("ended Failed" in e for e in failed["errors"])

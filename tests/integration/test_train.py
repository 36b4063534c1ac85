"""A trainer learns through the service, with the real libraries: TRL's GRPOTrainer (CPU, no
vLLM) with the rollout_func adapter, the tiny engine serving the policy to real sandboxes (a
private Redis, real Celery workers, bubblewrap), the learning tasks graded by hidden tests.
Two steps of the learning benchmark's own run: every episode a sample, every turn's recorded
ids what the engine was shown and sampled, each step's version published."""

from __future__ import annotations

import pytest

from benchmarks.bench_learning import one_run

pytestmark = [pytest.mark.train, pytest.mark.redis, pytest.mark.workers, pytest.mark.slow]


def test_two_grpo_steps_through_sandboxes_with_no_drift():
    result = one_run(steps=2, samples=4, seed=0, lr=1e-2)
    assert len(result["curve"]) == 2 and result["statuses"] == ["ok"]
    # 2 steps x 2 tasks x 4 samples x 2 turns, each checked against the engine's ledger.
    assert (result["turns_checked"], result["drift_mismatches"]) == (32, 0)
    assert result["published_version"] == "2" and result["engine_version"] == 2
    # Each step's wall split three ways: the tests ran, so grading has a share of its own.
    shares = [result[f"{part}_share"] for part in ("sampling", "grading", "optimizer")]
    assert all(0 < share < 1 for share in shares) and abs(sum(shares) - 1) < 0.01, shares

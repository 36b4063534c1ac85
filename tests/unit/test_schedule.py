import math

import pytest

from rollout_wire.errors import ConfigError
from rollout_worker.schedule import (
    EPISODE_FLOOR_SECONDS,
    deadline_problem,
    episode_floor,
    minimum_time,
)
from rollout_worker.settings import Settings


def test_the_minimum_is_the_larger_of_pod_creation_and_waves():
    plan = minimum_time(5000, 500, episode_seconds=1.0, create_rate=20.0)
    assert plan.creation_seconds == 5000 / 20 + 1.0  # the last Pod still has to run
    assert (plan.waves, plan.waves_seconds) == (10, 10.0)
    assert plan.minimum_seconds == 251.0

    plan = minimum_time(100, 10, episode_seconds=5.0, create_rate=20.0)
    assert (plan.creation_seconds, plan.waves, plan.waves_seconds) == (10.0, 10, 50.0)
    assert plan.minimum_seconds == 50.0


def test_waves_round_up_and_parallelism_above_count_is_one_wave():
    assert minimum_time(1001, 200, episode_seconds=2, create_rate=None).waves == 6
    assert minimum_time(10, 50, episode_seconds=2, create_rate=None).waves == 1


def test_without_a_create_rate_only_the_waves_count():
    plan = minimum_time(5000, 5000, episode_seconds=1.0, create_rate=None)
    assert (plan.creation_seconds, plan.minimum_seconds) == (0.0, 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"count": 0, "parallelism": 1, "episode_seconds": 1, "create_rate": None},
        {"count": 1, "parallelism": 0, "episode_seconds": 1, "create_rate": None},
        {"count": 1, "parallelism": 1, "episode_seconds": -1, "create_rate": None},
        {"count": 1, "parallelism": 1, "episode_seconds": 1, "create_rate": 0},
    ],
)
def test_nonsense_inputs_are_errors(kwargs):
    count, parallelism = kwargs.pop("count"), kwargs.pop("parallelism")
    with pytest.raises(ValueError):
        minimum_time(count, parallelism, **kwargs)


def test_the_episode_time_is_the_expected_one_when_known_else_the_backends_floor():
    assert episode_floor("kubernetes") == EPISODE_FLOOR_SECONDS["kubernetes"]
    assert episode_floor("local", None) == EPISODE_FLOOR_SECONDS["local"]
    assert episode_floor("kubernetes", 7.5) == 7.5
    assert episode_floor("kubernetes", 0) == EPISODE_FLOOR_SECONDS["kubernetes"]
    assert episode_floor("elsewhere") == 0.0


def test_a_5000_batch_in_the_default_deadline_is_refused_with_the_arithmetic():
    problem = deadline_problem(5000, 500, 240, backend="kubernetes", create_rate=20)
    assert problem is not None
    # Every number a user needs to check it, and what would make it fit.
    for text in (
        "5000 episodes",
        "deadline_seconds 240",
        "5000 Pods at 20/s",
        "ROLLOUT_POD_CREATE_RATE",
        "takes 250 s",
        "= 251 s",
        "10 wave(s) of at most 500 episodes x 1 s = 10 s",
        "needs at least 251 s",
        "deadline_seconds of at least 251",
        "batches of at most 4780 episodes",
    ):
        assert text in problem, (text, problem)


def test_a_batch_that_fits_is_not_refused():
    assert deadline_problem(5000, 500, 251, backend="kubernetes", create_rate=20) is None
    assert deadline_problem(1000, 200, 240, backend="kubernetes", create_rate=20) is None
    assert deadline_problem(5000, 500, 240, backend="kubernetes", create_rate=50) is None


def test_the_create_rate_counts_only_on_kubernetes_and_zero_turns_it_off():
    assert deadline_problem(5000, 5000, 240, backend="local", create_rate=20) is None
    assert deadline_problem(5000, 500, 240, backend="kubernetes", create_rate=0) is None
    assert deadline_problem(5000, 500, 240, backend="kubernetes", create_rate=None) is None


def test_too_many_waves_are_refused_with_the_parallelism_that_fits():
    problem = deadline_problem(
        100, 10, 20, backend="kubernetes", create_rate=20, expected_episode_seconds=5
    )
    assert problem is not None
    assert "an expected 5 s per episode" in problem
    assert "10 wave(s) of at most 10 episodes x 5 s = 50 s" in problem
    assert "parallelism of at least 25" in problem  # 4 waves of 5 s fit in 20 s
    assert "batches of at most" not in problem  # creation (10 s) fits


def test_a_deadline_shorter_than_one_episode_suggests_no_impossible_fix():
    problem = deadline_problem(
        10, 10, 3, backend="kubernetes", create_rate=20, expected_episode_seconds=5
    )
    assert problem is not None
    assert "parallelism of at least" not in problem and "batches of at most" not in problem
    assert "deadline_seconds of at least 6" in problem  # 10 / 20 + 5 = 5.5 -> 6


def test_the_tests_short_local_deadlines_stay_admissible():
    # tests/integration/test_worker_loss.py: 20 local episodes, parallelism 2, deadline 6 s.
    assert deadline_problem(20, 2, 6, backend="local", create_rate=20) is None
    # The largest local batch sequentially within the default deadline.
    assert deadline_problem(1200, 1, 240, backend="local", create_rate=20) is None
    assert deadline_problem(1201, 1, 240, backend="local", create_rate=20) is not None


def test_the_create_rate_setting():
    assert Settings().pod_create_rate == 10.0  # a stock kube-controller-manager (measured)
    assert Settings.from_env({"ROLLOUT_POD_CREATE_RATE": "55.5"}).pod_create_rate == 55.5
    assert Settings.from_env({"ROLLOUT_POD_CREATE_RATE": "0"}).pod_create_rate == 0.0
    for bad in ("-1", "nan"):
        with pytest.raises(ConfigError, match="ROLLOUT_POD_CREATE_RATE"):
            Settings.from_env({"ROLLOUT_POD_CREATE_RATE": bad})
    assert not math.isnan(Settings().pod_create_rate)

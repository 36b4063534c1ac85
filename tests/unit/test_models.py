import pytest

from rollout_wire.errors import InvalidSpec
from rollout_wire.request import BatchSpec, parse_spec
from rollout_worker.core import admit


def problems(request, max_episodes=100):
    """What the workers' edge says: the request's rules, then the resource arithmetic."""
    with pytest.raises(InvalidSpec) as info:
        admit(request, max_episodes=max_episodes)
    return " | ".join(info.value.problems)


def test_defaults_follow_the_guide():
    spec = parse_spec({"count": 10}, max_episodes=100)
    assert (spec.count, spec.parallelism) == (10, 10)
    assert spec.image == "python:3.12-alpine" and spec.runtime == "cube"
    assert spec.deadline_seconds == 240
    assert spec.resources.cpu_request == "100m" and spec.resources.memory_limit == "128Mi"
    assert spec.resources.storage_limit == "1Gi"  # the episode's disk, as before the field
    assert spec.batch_id  # generated when missing


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        ({"count": 0}, "count must be at least 1"),
        ({"count": 5, "parallelism": 6}, "1 <= parallelism <= count (5)"),
        ({"count": 5, "parallelism": 0}, "1 <= parallelism <= count"),
        ({"count": "ten"}, "count must be an integer"),
        ({"count": True}, "count must be an integer"),
        ({"count": 101}, "exceeds the configured maximum of 100"),
        ({"image": "Not An Image"}, "not a valid image reference"),
        ({"runtime": "Cube_Runtime"}, "not a valid RuntimeClass name"),
        ({"backend": "ssh"}, "backend 'ssh' is not one of"),
        ({"deadline_seconds": 0}, "deadline_seconds must be within"),
        ({"deadline_seconds": 10, "episode_timeout_seconds": 11}, "episode_timeout_seconds"),
        ({"resources": {"cpu_limit": "lots"}}, "cpu_limit 'lots' is not a quantity"),
        ({"resources": {"memory_limit": "12Qi"}}, "memory_limit '12Qi' is not a quantity"),
        ({"resources": {"memory_limit": "1e3"}}, "memory_limit '1e3' is not a quantity"),
        ({"resources": {"cpu_limit": 2}}, "cpu_limit 2 is not a quantity"),
        ({"resources": {"cpu_request": "2", "cpu_limit": "1"}}, "exceeds cpu_limit"),
        ({"resources": {"memory_limit": "16Mi", "memory_request": "8Mi"}}, "below 32Mi"),
        ({"resources": {"gpu": "1"}}, "unknown resources fields"),
        ({"resources": {"storage_limit": "lots"}}, "storage_limit 'lots' is not a quantity"),
        ({"resources": {"storage_limit": "500m"}}, "storage_limit '500m' is not a quantity"),
        ({"resources": {"storage_limit": "512Ki"}}, "storage_limit 512Ki is below 1Mi"),
        ({"action": "delete-everything"}, "action"),
        ({"batch_id": "Has Spaces"}, "batch_id"),
        ({"colour": "blue"}, "unknown fields ['colour']"),
    ],
)
def test_bad_input_is_refused_with_what_is_allowed(request_, expected):
    assert expected in problems(request_)


def test_a_receipt_from_before_storage_limit_decodes_with_the_old_disk_limit():
    spec = parse_spec({"count": 1, "resources": {"storage_limit": "64Mi"}}, max_episodes=10)
    assert BatchSpec.from_dict(spec.to_dict()).resources.storage_limit == "64Mi"
    old = spec.to_dict()
    del old["resources"]["storage_limit"]
    assert BatchSpec.from_dict(old).resources.storage_limit == "1Gi"


def test_all_problems_are_reported_at_once():
    text = problems({"count": 0, "image": "BAD", "runtime": "X"})
    assert "count" in text and "image" in text and "runtime" in text


def test_oversized_batch_is_refused_not_truncated():
    with pytest.raises(InvalidSpec, match="split it into several batches"):
        parse_spec({"count": 5001}, max_episodes=5000)


def test_spec_round_trips_through_json_dict():
    spec = parse_spec({"count": 3, "parallelism": 2, "labels": {"round": "7"}}, max_episodes=10)
    assert BatchSpec.from_dict(spec.to_dict()) == spec


def test_the_trainer_side_leaves_the_size_limit_to_the_workers():
    assert parse_spec({"count": 10**6}, max_episodes=None).count == 10**6


def test_a_batch_that_cannot_be_created_within_its_deadline_is_refused_at_the_edge():
    request = {"count": 5000, "parallelism": 500, "backend": "kubernetes"}
    with pytest.raises(InvalidSpec) as info:
        admit(request, max_episodes=5000, pod_create_rate=20)
    (problem,) = info.value.problems
    assert "5000 Pods at 20/s" in problem and "needs at least 251 s" in problem
    # The same batch with a deadline that fits, or where creation is not rate-limited.
    assert admit({**request, "deadline_seconds": 300}, 5000, pod_create_rate=20).count == 5000
    assert admit(request, max_episodes=5000, pod_create_rate=0).count == 5000
    assert admit({**request, "backend": "local"}, 5000, pod_create_rate=20).count == 5000


def test_the_retry_budget_is_bounded():
    assert parse_spec({"count": 1, "infra_retries": 3}, max_episodes=10).infra_retries == 3
    with pytest.raises(InvalidSpec, match=r"infra_retries must be within 0..3, got 9"):
        parse_spec({"count": 1, "infra_retries": 9}, max_episodes=10)


def test_a_redis_password_is_never_shown():
    from rollout_wire.urls import redacted

    assert redacted("redis://:s3cret@10.0.0.1:6380/0") == "redis://:***@10.0.0.1:6380/0"
    assert redacted("rediss://app:s3cret@redis.example/1") == "rediss://app:***@redis.example/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"

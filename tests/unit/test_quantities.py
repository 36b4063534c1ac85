from decimal import Decimal

import pytest

from rollout_worker.quantities import parse_cpu, parse_memory


@pytest.mark.parametrize(
    ("text", "cores"), [("500m", "0.5"), ("2", "2"), ("0.25", "0.25"), ("1500m", "1.5")]
)
def test_cpu(text, cores):
    assert parse_cpu(text) == Decimal(cores)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("128Mi", 128 * 2**20),
        ("1Gi", 2**30),
        ("500M", 500 * 10**6),
        ("768Mi", 768 * 2**20),
        ("1024", 1024),
    ],
)
def test_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "1.5x", "-1", "m", "12 Mi"])
def test_garbage_is_refused(text):
    with pytest.raises(ValueError):
        parse_memory(text)
    with pytest.raises(ValueError):
        parse_cpu(text)

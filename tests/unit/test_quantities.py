from rollout_wire.request import Resources
from rollout_worker.quantities import format_memory, resource_problems, sandbox_limits


def test_limits_of_a_local_sandbox_follow_the_requested_resources():
    memory, cpu_seconds = sandbox_limits(Resources(cpu_limit="500m", memory_limit="128Mi"), 120)
    assert memory == 128 * 2**20 + 256 * 2**20  # plus the interpreter's address-space headroom
    assert cpu_seconds == 61  # half a core for 120 s, rounded up


def test_resource_arithmetic_uses_every_unit_a_request_may_use():
    assert resource_problems(Resources("1", "1Gi", "1500m", "1Gi")) == []
    assert resource_problems(Resources("0.5", "500M", "0.5", "1Gi")) == []
    assert "exceeds memory_limit" in " ".join(resource_problems(Resources("1", "2G", "1", "1Gi")))


def test_format_memory_picks_the_largest_exact_binary_unit():
    assert (format_memory(768 * 2**20), format_memory(2**30), format_memory(1000)) == (
        "768Mi",
        "1Gi",
        "1000",
    )

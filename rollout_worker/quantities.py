"""Resource quantities: the Kubernetes client parses them; here is only our policy on top."""

from __future__ import annotations

from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from rollout_wire.request import Resources

__all__ = [
    "format_memory",
    "parse_quantity",
    "resource_problems",
    "sandbox_limits",
    "storage_bytes",
]

# Python cannot start below this.
MIN_MEMORY_LIMIT = 32 * 2**20
# An episode's files (the runner's own included) need some disk.
MIN_STORAGE_LIMIT = 2**20
# Python maps far more address space than it touches: the local sandbox's RLIMIT_AS gets this
# headroom over the memory limit so that the limit still bounds real use.
ADDRESS_SPACE_HEADROOM = 256 * 2**20

_BINARY = {"Ti": 2**40, "Gi": 2**30, "Mi": 2**20, "Ki": 2**10}


def resource_problems(res: Resources) -> list[str]:
    """What is wrong with requests and limits whose syntax the request already checked."""
    cpu_req, cpu_lim = parse_quantity(res.cpu_request), parse_quantity(res.cpu_limit)
    mem_req, mem_lim = parse_quantity(res.memory_request), parse_quantity(res.memory_limit)
    problems = []
    if cpu_req <= 0 or mem_req <= 0:
        problems.append("resources: requests must be greater than zero")
    if cpu_req > cpu_lim:
        problems.append(
            f"resources: cpu_request {res.cpu_request} exceeds cpu_limit {res.cpu_limit}"
        )
    if mem_req > mem_lim:
        problems.append(
            f"resources: memory_request {res.memory_request} exceeds "
            f"memory_limit {res.memory_limit}"
        )
    if mem_lim < MIN_MEMORY_LIMIT:
        problems.append(
            f"resources: memory_limit {res.memory_limit} is below 32Mi; Python cannot start in less"
        )
    if parse_quantity(res.storage_limit) < MIN_STORAGE_LIMIT:
        problems.append(
            f"resources: storage_limit {res.storage_limit} is below 1Mi; an episode's own files "
            "need more"
        )
    return problems


def storage_bytes(res: Resources) -> int:
    """The episode's disk limit in bytes (`Resources.storage_limit`)."""
    return int(parse_quantity(res.storage_limit))


def sandbox_limits(res: Resources, episode_timeout: float) -> tuple[int, int]:
    """(address-space bytes, CPU seconds) that stand in for cgroup limits in a local sandbox."""
    memory = int(parse_quantity(res.memory_limit)) + ADDRESS_SPACE_HEADROOM
    cpu_seconds = max(1, int(parse_quantity(res.cpu_limit) * Decimal(episode_timeout)) + 1)
    return memory, cpu_seconds


def format_memory(size: int) -> str:
    for suffix, scale in _BINARY.items():
        if size >= scale and size % (scale // 1024 or 1) == 0:
            return f"{size / scale:g}{suffix}"
    return str(size)

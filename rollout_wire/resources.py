"""A batch's per-sandbox resources (`Resources`) and the quantity forms a request may use.

Parsed here once at each edge (`parse_resources`, one of request.py's fields); the workers
compare the values with the Kubernetes client's own parser (`rollout_worker.quantities`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from rollout_wire.field_table import ParseState

# The episode's disk (its workspace and other on-disk folders, a writable root, its logs)
# unless the batch says otherwise: Kubernetes' ephemeral-storage limit and each on-disk
# emptyDir's sizeLimit; the local supervisor measures the same folders against it.
DEFAULT_STORAGE_LIMIT = "1Gi"


@dataclass(frozen=True)
class Resources:
    """Per-sandbox requests and limits, in Kubernetes quantity syntax. `storage_limit`: the
    episode's disk; an episode past it is ended as its own failure (never infrastructure)."""

    cpu_request: str = "100m"
    memory_request: str = "64Mi"
    cpu_limit: str = "500m"
    memory_limit: str = "128Mi"
    storage_limit: str = DEFAULT_STORAGE_LIMIT


# Which quantity forms a request may use (the policy); their values are compared by the workers
# with the Kubernetes client's own parser (`rollout_worker.quantities`).
CPU_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
MEMORY_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def parse_resources(request: ParseState) -> Resources:
    """The request's `resources`: known fields only, each a quantity of its kind."""
    data, problems = request.data.get("resources", {}), request.problems
    if isinstance(data, Resources):
        data = asdict(data)
    if not isinstance(data, Mapping):
        problems.append(f"resources must be an object, got {data!r}")
        return Resources()
    allowed = {f.name for f in fields(Resources)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        problems.append(f"unknown resources fields {unknown}; allowed: {sorted(allowed)}")
        return Resources()
    bad = False
    for name, value in data.items():
        pattern = CPU_QUANTITY if name.startswith("cpu") else MEMORY_QUANTITY
        if not isinstance(value, str) or not pattern.match(value):
            example = "'500m' or '1.5'" if name.startswith("cpu") else "'128Mi', '1Gi' or '500M'"
            problems.append(f"resources: {name} {value!r} is not a quantity like {example}")
            bad = True
    return Resources() if bad else Resources(**data)

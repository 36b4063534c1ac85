"""Kubernetes resource quantities (the subset we accept), parsed without I/O."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_CPU = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m)?$")


def parse_cpu(text: str) -> Decimal:
    """'500m' -> 0.5 cores; '2' -> 2 cores. Raises ValueError with what is allowed."""
    match = _CPU.match(str(text).strip())
    if not match:
        raise ValueError(f"cpu quantity {text!r} is not like '500m' or '1.5'")
    try:
        value = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex already guards this
        raise ValueError(f"cpu quantity {text!r} is not a number") from exc
    return value / 1000 if match.group(2) else value


def parse_memory(text: str) -> int:
    """'128Mi' -> bytes. Raises ValueError with what is allowed."""
    match = _MEMORY.match(str(text).strip())
    if not match:
        raise ValueError(
            f"memory quantity {text!r} is not like '128Mi', '1Gi', '500M' or a byte count"
        )
    number, suffix = Decimal(match.group(1)), match.group(2)
    scale = _BINARY.get(suffix or "") or _DECIMAL.get(suffix or "") or 1
    return int(number * scale)


def format_memory(size: int) -> str:
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        if size >= _BINARY[suffix] and size % (_BINARY[suffix] // 1024 or 1) == 0:
            return f"{size / _BINARY[suffix]:g}{suffix}"
    return str(size)

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


_ANY = re.compile(
    r"^([+]?[0-9]+(?:\.[0-9]*)?|[+]?\.[0-9]+)(?:([eE][-+]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$"
)
_ANY_SCALE = {
    **{s: Decimal(v) for s, v in _BINARY.items()},
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def parse_quantity(text: str) -> Decimal:
    """Any Kubernetes quantity as the API server returns it ('1k', '4Ti', '1900m', '1e3')."""
    match = _ANY.match(str(text).strip())
    if not match:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number = Decimal(match.group(1))
    if match.group(2):
        return number * Decimal(10) ** int(match.group(2)[1:])
    return number * _ANY_SCALE.get(match.group(3) or "", Decimal(1))


def format_memory(size: int) -> str:
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        if size >= _BINARY[suffix] and size % (_BINARY[suffix] // 1024 or 1) == 0:
            return f"{size / _BINARY[suffix]:g}{suffix}"
    return str(size)

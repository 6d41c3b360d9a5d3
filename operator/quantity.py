"""Kubernetes quantities ("8Gi", "500m", 2): read into numbers and bytes, and bytes written
back in Gi or Mi. Below the spec and everything that sizes pods."""

from __future__ import annotations

import re

from kvserve.operator.errors import InvalidSpecError

GiB = 1 << 30
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?|m|k)?$")
_SUFFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "E": 10**18, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
           "Pi": 1 << 50, "Ei": 1 << 60, "m": 1e-3}


def quantity_value(text: str | int | float) -> float | None:
    """The number a Kubernetes quantity stands for ("8Gi", "500m", 2), or None if it is not one."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        return None
    try:
        return float(match.group(1)) * _SUFFIX[match.group(2) or ""]
    except ValueError:
        return None


def parse_quantity(text: str | int | float) -> int:
    """Bytes of a Kubernetes quantity such as "8Gi", "500M" or 1024."""
    value = quantity_value(text)
    if value is None:
        raise InvalidSpecError(f"cannot read the quantity {text!r} (write e.g. 8Gi or 8000Mi)")
    return int(value)


def quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, in Gi or Mi where exact."""
    for suffix, unit in (("Gi", GiB), ("Mi", 1 << 20)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)

"""Which implementation serves a call: "auto" is Triton on CUDA when Triton imports, else torch."""

from __future__ import annotations

import functools

import torch

from kvserve.kernels.checks import BACKENDS, require


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch", "triton" or "reference") for a call on `device`."""
    require(backend in BACKENDS, "backend", f"expected one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and triton_available() else "torch"

"""Which implementation serves a call: "auto" is Triton on CUDA when Triton imports; on the CPU
the fused C++ decode kernel ("cpu") when it builds, else the torch path."""

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
    """The concrete backend ("cpu", "torch", "triton" or "reference") for a call on `device`."""
    require(backend in BACKENDS, "backend", f"expected one of {BACKENDS}, got {backend!r}")
    if backend == "cpu":
        require(device.type == "cpu", "backend", f'"cpu" runs on CPU tensors, not {device.type}')
        require(cpu_kernel_available(), "backend",
                '"cpu": the C++ kernel could not be built here (see the log); use "torch"')
        return backend
    if backend != "auto":
        return backend
    if device.type == "cuda" and triton_available():
        return "triton"
    return "cpu" if device.type == "cpu" and cpu_kernel_available() else "torch"


def cpu_kernel_available() -> bool:
    from kvserve.kernels.cpu_attention import available

    return available()

"""W8A8 int8 matmul on the CPU: int8 weights per output channel, int8 activations per token,
through oneDNN's prepacked int8 linear (AMX-INT8 on Sapphire Rapids, VNNI on AVX-512 CPUs), or
torch._int_mm (oneDNN's s8 x s8 -> s32 GEMM) where that linear would run oneDNN's reference
kernel."""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import Tensor, nn

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization.activation import fused_rows, int8_per_token
from kvserve.engine.layers.quantization.qweight import QuantizedWeight


logger = logging.getLogger("kvserve.engine")

REFERENCE_SLOWDOWN = 10  # oneDNN's reference int8 kernel is ~1000x slower than its GEMM


def onednn_int8_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise") \
        and torch.backends.mkldnn.is_available()


def _best_seconds(fn, reps: int = 3) -> float:
    fn()  # the first call builds oneDNN's primitive
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def onednn_int8_fast() -> bool:
    """Whether oneDNN's prepacked int8 linear runs an optimised kernel on this CPU.

    On some AVX-512 CPUs with VNNI (a Zen 4 EPYC, oneDNN 3.12) its matmul for signed int8
    activations falls back to `ref_int8`: exact, but a 64 x 576 x 960 product took 0.7 s
    against 0.2 ms for bf16, so a W8A8 model generated 0.2 tokens a second. Timed once per
    process on a 16 x 256 x 256 probe against torch._int_mm, oneDNN's s8 x s8 -> s32 GEMM
    (optimised wherever oneDNN has VNNI); the reference kernel is ~1000x slower, an optimised
    one at most a few times, so the threshold (10x) has room on both sides.
    """
    if not onednn_int8_available():
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (256, 256), dtype=torch.int8, generator=g)
    x = torch.randint(-128, 128, (16, 256), dtype=torch.int8, generator=g)
    try:
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        scale, zero = torch.ones(256), torch.zeros(256, dtype=torch.int64)
        linear = _best_seconds(lambda: torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 0, packed, scale, zero, None, 1.0, 0, torch.float32, "none", [None], ""))
        gemm = _best_seconds(lambda: torch._int_mm(x, w.t()))
    except RuntimeError:
        return False
    fast = linear < REFERENCE_SLOWDOWN * gemm
    if not fast:
        logger.info("oneDNN's int8 linear runs its reference kernel on this CPU (%.1f ms against "
                    "%.3f ms for torch._int_mm on a probe): W8A8 uses torch._int_mm",
                    linear * 1e3, gemm * 1e3)
    return fast


@functools.cache
def cpu_int_mm_exact() -> bool:
    """Whether torch._int_mm serves CPU tensors here, exactly (int32 accumulation)."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (3, 72), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (72, 5), dtype=torch.int8, generator=g)
    try:
        return torch.equal(torch._int_mm(a, b), (a.long() @ b.long()).int())
    except (RuntimeError, NotImplementedError):
        return False


class Int8W8A8Linear(nn.Module):
    """y = (q(x) @ Wq^T) * s_x * s_w: the int32 accumulation and the weight scale run inside
    oneDNN (weight scale per channel, x scale 1), the per-token x scale is one multiply after."""

    def __init__(self, w: QuantizedWeight, static_input_scale: float | None = None) -> None:
        super().__init__()
        if w.is_float or w.bits != 8 or w.zero is not None or w.scale.shape[1] != 1:
            raise QuantizationError(
                "the int8 W8A8 kernel takes symmetric int8 weights with one scale per output "
                f"channel (got {w.bits} bits, {w.scale.shape[1]} group(s), "
                f"{'asymmetric' if w.zero is not None else 'symmetric'})")
        self.in_features, self.out_features = w.in_features, w.out_features
        self.static_input_scale = static_input_scale
        values = w.values.contiguous()
        self.register_buffer("weight_scale", w.scale[:, 0].float().contiguous(), persistent=False)
        self.register_buffer("weight_zero", torch.zeros(self.out_features, dtype=torch.int64),
                             persistent=False)
        self.onednn = values.device.type == "cpu" and onednn_int8_fast()
        if self.onednn:
            self.register_buffer("weight", torch.ops.onednn.qlinear_prepack(values, None),
                                 persistent=False)
            self.onednn = self._onednn_agrees(values)
        if not self.onednn:  # plain int8 GEMM (torch._int_mm takes a [K, N] column-major weight)
            self.register_buffer("weight", values.t(), persistent=False)
        # the decode hot path (dynamic scales, oneDNN, the C++ row ops) decided once: at the
        # default model's widths a linear is ~40 us, and each Python-level check costs ~1 us
        self._fast = self.onednn and static_input_scale is None and _row_ops()

    def _onednn_agrees(self, values: Tensor) -> bool:
        """oneDNN's s8 x s8 product equals the exact one on a probe (CPUs without VNNI / AMX
        may lack the signed-activation path): else the plain GEMM is used."""
        probe = torch.randint(-128, 128, (3, self.in_features), dtype=torch.int8,
                              generator=torch.Generator().manual_seed(0))
        try:
            got = torch.ops.onednn.qlinear_pointwise(
                probe, 1.0, 0, self.weight, self.weight_scale, self.weight_zero, None, 1.0, 0,
                torch.float32, "none", [None], "")
        except RuntimeError:
            return False
        want = (probe.double() @ values.double().t()) * self.weight_scale.double()
        return bool(torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max())))

    def forward(self, x: Tensor) -> Tensor:
        if self._fast and x.dim() == 2 and x.stride(1) == 1 and x.dtype in _ROW_DTYPES:
            codes, x_scale = _QUANT_ROWS(x)
            y = _QLINEAR(codes, 1.0, 0, self.weight, self.weight_scale, self.weight_zero, None,
                         1.0, 0, torch.float32, "none", [None], "")
            return _SCALE_ROWS(y, x_scale, x.dtype)
        codes, x_scale = int8_per_token(x, self.static_input_scale)
        if self.onednn:
            y = torch.ops.onednn.qlinear_pointwise(
                codes, 1.0, 0, self.weight, self.weight_scale, self.weight_zero, None, 1.0, 0,
                torch.float32, "none", [None], "")
            if fused_rows(x):  # the per-token rescale and the cast in one pass
                return torch.ops.kvserve_ops.scale_rows(y, x_scale, x.dtype)
        else:
            y = _int_mm(codes, self.weight).float() * self.weight_scale
        return (y * x_scale).to(x.dtype)


_ROW_DTYPES = (torch.float32, torch.bfloat16)
_QUANT_ROWS = _QLINEAR = _SCALE_ROWS = None


def _row_ops() -> bool:
    """Whether the C++ row ops are built; binds the three ops of the fast path once."""
    global _QUANT_ROWS, _QLINEAR, _SCALE_ROWS
    from kvserve.kernels.cpu_ops import fused_available

    if not fused_available():
        return False
    _QUANT_ROWS = torch.ops.kvserve_ops.quant_int8_rows.default
    _QLINEAR = torch.ops.onednn.qlinear_pointwise.default
    _SCALE_ROWS = torch.ops.kvserve_ops.scale_rows.default
    return True


def _int_mm(a: Tensor, b: Tensor) -> Tensor:
    if (a.is_cuda and a.shape[0] > 16) or (a.device.type == "cpu" and cpu_int_mm_exact()):
        return torch._int_mm(a, b)
    return (a.float() @ b.float()).to(torch.int32)  # exact below 2^24 per dot product

"""FP8 (e4m3) KV-cache helpers: the per-tensor scale the engine stores with each fp8 cache."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Like vLLM's K_SCALE_CONSTANT (200): the first batch's largest value maps to 448 / 2.24 = 200,
# leaving headroom for larger values in later tokens.
DEFAULT_HEADROOM = FP8_MAX / 200.0


def compute_kv_scale(x: torch.Tensor, headroom: float = DEFAULT_HEADROOM) -> float:
    """Per-tensor scale for storing `x` (e.g. one layer's keys of a first batch) as e4m3.

    stored = x / scale, so the largest |x| is stored as 448 / headroom. Never below 1e-6.
    """
    if headroom < 1.0:
        raise ValueError(f"headroom: must be >= 1.0 so values fit in e4m3, got {headroom}")
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return max(amax * headroom / FP8_MAX, 1e-6)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE

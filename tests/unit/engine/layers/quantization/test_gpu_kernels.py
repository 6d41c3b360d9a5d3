"""The GPU's quantised matmuls, testable without one: the Triton W4A16 GEMM (dequantising inside
the tile) under TRITON_INTERPRET=1 on CPU tensors against dequantise-then-matmul, and the kernel
selection by compute capability (FP8 _scaled_mm from SM89, row-wise scales from SM90)."""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels import random_weight

from kvserve.engine.layers.quantization.activation import ActivationScheme
from kvserve.engine.layers.quantization.gpu_linear import TritonW4A16Linear, gpu_kernel_choice
from kvserve.engine.layers.quantization.qweight import QuantizedWeight

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(), reason="needs Triton")


@pytest.mark.parametrize("group,asym,act_order", [(32, False, False), (64, True, False),
                                                  (32, True, True)])
def test_triton_w4a16_matches_the_dequantised_weight(group, asym, act_order):
    w = random_weight(4, group, asym, act_order)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, w.in_features, generator=torch.Generator().manual_seed(1))
    lin = TritonW4A16Linear(w, torch.float32)
    assert lin.packed.dtype == torch.uint8
    assert lin.packed.numel() == w.in_features * w.out_features // 2  # two codes a byte
    got = lin.to(device)(x.to(device)).cpu()
    want = x @ w.dequantize().t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def fp8_weight(per_tensor: bool) -> QuantizedWeight:
    values = torch.randn(64, 32).to(torch.float8_e4m3fn)
    scale = torch.full((64, 1), 0.5) if per_tensor else torch.rand(64, 1)
    return QuantizedWeight(values, scale, None, 32, 8)


FP8_DYN, FP8_STATIC = ActivationScheme("fp8"), ActivationScheme("fp8", static=True)


@pytest.mark.parametrize("capability,weight,act,want", [
    (None, "fp8_channel", FP8_DYN, "dequant"),          # not a CUDA device
    ((8, 0), "fp8_channel", FP8_DYN, "dequant"),        # Ampere: no FP8 tensor cores
    ((8, 9), "fp8_channel", FP8_DYN, "dequant"),        # Ada: per-tensor scales only
    ((8, 9), "fp8_tensor", FP8_STATIC, "scaled_mm_fp8"),
    ((9, 0), "fp8_channel", FP8_DYN, "scaled_mm_fp8"),  # Hopper: row-wise scales
    ((9, 0), "fp8_channel", None, "dequant"),           # weight-only FP8: activations stay 16-bit
    ((9, 0), "int4", None, "triton_w4a16"),
    ((8, 0), "int4", None, "triton_w4a16"),
    ((9, 0), "int8", None, "dequant"),
])
def test_gpu_kernel_selection_follows_capability_and_scheme(capability, weight, act, want):
    w = {"fp8_channel": lambda: fp8_weight(False), "fp8_tensor": lambda: fp8_weight(True),
         "int4": lambda: random_weight(4, 32, False), "int8": lambda: random_weight(8, 32, False)
         }[weight]()
    assert gpu_kernel_choice(w, act, capability) == want

"""The quantised matmuls against dequantise-then-matmul in fp32: int8 W8A8 (oneDNN), W4A16 and
W8A16 (torch's packed CPU kernels, with groups, zero points and act order), FP8 blocks, and the
int32 unpacking against compressed-tensors' own packer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvserve.engine.layers.quantization.activation import ActivationScheme, fp8_fake_quant, \
    int8_per_token
from kvserve.engine.layers.quantization.base import LinearMethod
from kvserve.engine.layers.quantization.dequant import DequantLinear
from kvserve.engine.layers.quantization import int8_w8a8
from kvserve.engine.layers.quantization.int8_w8a8 import Int8W8A8Linear, onednn_int8_available
from kvserve.engine.layers.quantization.online import quantize_fp8_per_channel
from kvserve.engine.layers.quantization.qweight import QuantizedWeight, unpack_int32
from kvserve.engine.layers.quantization.weight_only import INT4_KERNEL_MAX_ROWS, Int4WeightLinear, \
    Int8WeightLinear, int4pack_block

OUT, IN = 96, 256


def random_weight(bits: int, group: int, asym: bool, act_order: bool = False,
                  seed: int = 0, out: int = OUT) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(lo, hi + 1, (out, IN), generator=g, dtype=torch.int8)
    groups = IN // group
    scale = torch.rand(out, groups, generator=g) * 0.02 + 0.001
    zero = torch.randint(lo, hi + 1, (out, groups), generator=g, dtype=torch.int8) if asym else None
    g_idx = None
    if act_order:  # GPTQ desc_act: columns assigned to groups in a shuffled order
        g_idx = (torch.randperm(IN, generator=g) // group).to(torch.int32)
    return QuantizedWeight(values, scale, zero, group, bits, g_idx)


def x_batch(rows: int = 7, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(1)).to(dtype)


def reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return x.double() @ w.dequantize(torch.float64).t()


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


@pytest.mark.parametrize("group", [32, 128, IN])
@pytest.mark.parametrize("asym", [False, True])
def test_int4_kernel_matches_dequantised_weight(group, asym):
    w = random_weight(4, group, asym)
    close(Int4WeightLinear(w, torch.float32)(x_batch()), reference(x_batch(), w), 1e-5)


def test_int4_kernel_takes_act_order_groups():
    w = random_weight(4, 64, True, act_order=True)
    assert w.g_idx is not None
    close(Int4WeightLinear(w, torch.float32)(x_batch()), reference(x_batch(), w), 1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_prefill_rows_read_the_packed_bytes_back_exactly(act_order):
    """Past INT4_KERNEL_MAX_ROWS the weight is dequantised from the int4pack bytes (whose
    layout is known for outputs in whole blocks of 64 rows with AVX-512, 32 with AVX2; other
    widths keep the int4 kernel)."""
    assert int4pack_block() in (32, 64)  # this CPU's layout was recognised
    assert not Int4WeightLinear(random_weight(4, 64, True, out=80), torch.float32).unpackable
    w = random_weight(4, 64, True, act_order=act_order, out=192)
    kernel = Int4WeightLinear(w, torch.float32)
    assert kernel.unpackable
    x = x_batch(INT4_KERNEL_MAX_ROWS + 5)
    close(kernel(x), reference(x, w), 1e-5)
    decode = kernel(x[:INT4_KERNEL_MAX_ROWS])  # the int4 kernel itself
    close(decode, reference(x[:INT4_KERNEL_MAX_ROWS], w), 1e-5)


@pytest.mark.parametrize("asym", [False, True])
def test_int8_weight_only_kernel_matches(asym):
    w = random_weight(8, IN, asym)
    close(Int8WeightLinear(w, torch.float32)(x_batch()), reference(x_batch(), w), 1e-5)


def _cpu_has_int8_dot_product() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def test_int8_w8a8_kernel_is_the_integer_product_of_the_rounded_input():
    w = random_weight(8, IN, False)
    x = x_batch(33)
    codes, scale = int8_per_token(x)
    assert bool(((codes.float() * scale - x).abs() <= scale * 0.5001).all())  # rounding, no clamp
    want = (codes.double() * scale.double()) @ w.dequantize(torch.float64).t()
    kernel = Int8W8A8Linear(w)
    # oneDNN's signed int8 product is exact with VNNI or AMX; on an AVX2-only CPU its probe
    # disagrees, and where it would run its reference kernel (timed at load) the plain int8
    # GEMM serves instead (either way the product below is exact)
    assert kernel.onednn == (onednn_int8_available() and _cpu_has_int8_dot_product()
                             and not _onednn_reports_reference_int8_matmul())
    close(kernel(x), want, 1e-6)


def _onednn_reports_reference_int8_matmul() -> bool:
    """oneDNN's own word (ONEDNN_VERBOSE, in a fresh process) on which implementation its int8
    linear runs here: `ref_int8` is the reference kernel."""
    # the shape int8_w8a8.onednn_int8_fast times (16 x 256 x 256): oneDNN picks its kernel per
    # shape (with AMX, `ref_int8` for a 4 x 64 x 64 product and AMX brgemm for this one)
    code = ("import torch; w = torch.randint(-128, 128, (256, 256), dtype=torch.int8); "
            "p = torch.ops.onednn.qlinear_prepack(w, None); "
            "torch.ops.onednn.qlinear_pointwise(torch.ones(16, 256, dtype=torch.int8), 1.0, 0, "
            "p, torch.ones(256), torch.zeros(256, dtype=torch.int64), None, 1.0, 0, "
            "torch.float32, 'none', [None], '')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    # onednn_verbose,v1,primitive,exec,cpu,matmul,<implementation>,...
    matmuls = [line.split(",")[6] for line in out.splitlines() if ",exec,cpu,matmul," in line]
    assert matmuls, out[-2000:]
    return any(impl.startswith("ref") for impl in matmuls)


def test_int8_w8a8_plain_gemm_path_is_exact_too(monkeypatch):
    """Where oneDNN's linear is slow (its reference kernel) the layer takes torch._int_mm:
    the same integer product, so the same result as the reference."""
    monkeypatch.setattr(int8_w8a8, "onednn_int8_fast", lambda: False)
    w = random_weight(8, IN, False)
    x = x_batch(33)
    codes, scale = int8_per_token(x)
    want = (codes.double() * scale.double()) @ w.dequantize(torch.float64).t()
    kernel = Int8W8A8Linear(w)
    assert not kernel.onednn and not kernel._fast
    close(kernel(x), want, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_w8a8_fast_path_gives_the_general_paths_bits(dtype):
    """The decode path bound once at load (C++ quantise, oneDNN, C++ rescale) against the
    general forward (per-call checks), on rows both paths take."""
    kernel = Int8W8A8Linear(random_weight(8, IN, False))
    if not kernel._fast:
        pytest.skip("no oneDNN int8 with the C++ row ops on this machine: one path only")
    x = x_batch(19, dtype) * 3
    fast = kernel(x)
    kernel._fast = False
    assert torch.equal(fast, kernel(x)) and fast.dtype == dtype


def test_int8_w8a8_with_a_static_input_scale_clamps_to_it():
    w = random_weight(8, IN, False)
    x = x_batch() * 10
    codes, scale = int8_per_token(x, 0.01)
    assert codes.min() == -128 and codes.max() == 127 and bool((scale == 0.01).all())
    want = (codes.double() * 0.01) @ w.dequantize(torch.float64).t()
    close(Int8W8A8Linear(w, 0.01)(x), want, 1e-6)


def test_fp8_block_weights_dequantise_per_block_with_fp8_activations():
    g = torch.Generator().manual_seed(2)
    codes = (torch.randn(OUT, IN, generator=g) * 50).to(torch.float8_e4m3fn)
    block_scale = torch.rand(1, IN // 128, generator=g) + 0.5  # rows 96 < one 128-row block
    w = QuantizedWeight(codes, block_scale.expand(OUT, -1).contiguous(), None, 128, 8)
    x = x_batch()
    kernel = DequantLinear(w, torch.float32, ActivationScheme("fp8"))
    close(kernel(x), reference(fp8_fake_quant(x), w), 1e-6)
    assert not torch.equal(fp8_fake_quant(x), x)  # the activations really were rounded


def test_per_channel_fp8_quantisation_round_trips_within_fp8_precision():
    dense = torch.randn(OUT, IN)
    w = quantize_fp8_per_channel(dense)
    assert w.values.dtype == torch.float8_e4m3fn
    close(w.dequantize(), dense.double(), 0.07)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_unpacking_inverts_compressed_tensors_packing(bits, dim):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = random_weight(bits, IN, False).values
    packed = pack_to_int32(codes, bits, packed_dim=dim)
    got = unpack_int32(packed, bits, codes.shape[dim], dim) - (1 << (bits - 1))
    assert torch.equal(got.to(torch.int8), codes)


def test_kernel_choice_follows_the_weight_and_activations():
    class M(LinearMethod):
        leaves = frozenset()

        def read(self, tensors, name):  # pragma: no cover - not used here
            raise NotImplementedError

    assert isinstance(M("w4").kernel(random_weight(4, 32, True), torch.float32), Int4WeightLinear)
    assert isinstance(M("w8").kernel(random_weight(8, IN, False), torch.float32), Int8WeightLinear)
    a8 = M("w8a8", ActivationScheme("int8"))
    assert isinstance(a8.kernel(random_weight(8, IN, False), torch.float32), Int8W8A8Linear)
    # int8 with groups has no fused kernel: dequantised per call, still exact
    w = random_weight(8, 64, True)
    kernel = M("w8g").kernel(w, torch.float32)
    assert isinstance(kernel, DequantLinear)
    close(kernel(x_batch()), reference(x_batch(), w), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_per_token_int8_gives_the_torch_expressions_codes_and_scales(dtype):
    """The C++ one-pass quantiser (kernels/csrc/cpu_quant.cpp) against the torch reference,
    bit for bit: ties round half to even, the range clamps to [-128, 127], a zero row gets eps."""
    from kvserve.engine.layers.quantization.activation import fused_rows, torch_int8_per_token

    x = (torch.randn(19, 200, generator=torch.Generator().manual_seed(4)) * 5).to(dtype)
    x[2] = 0
    x[3, :6] = torch.tensor([127.5, 0.5, 1.5, 2.5, -2.5, -127.5])  # scale 1: exact ties
    if not fused_rows(x):
        pytest.skip("the C++ ops are not built here")
    codes, scale = int8_per_token(x)
    want_codes, want_scale = torch_int8_per_token(x)
    assert codes.dtype == torch.int8 and scale.shape == (19, 1)
    assert torch.equal(scale, want_scale) and torch.equal(codes, want_codes)
    assert codes[3, :6].tolist() == [127, 0, 2, 2, -2, -128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rescale_after_the_int8_gemm_equals_multiply_then_cast(dtype):
    from kvserve.engine.layers.quantization.activation import fused_rows

    y = torch.randn(7, 300, generator=torch.Generator().manual_seed(5)) * 100
    s = torch.rand(7, 1, generator=torch.Generator().manual_seed(6))
    if not fused_rows(y):
        pytest.skip("the C++ ops are not built here")
    got = torch.ops.kvserve_ops.scale_rows(y, s, dtype)
    assert got.dtype == dtype and torch.equal(got, (y * s).to(dtype))

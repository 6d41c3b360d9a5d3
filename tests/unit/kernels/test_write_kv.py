"""write_kv round trips (torch and reference paths), skipped slots, fp8 quantisation bounds."""

import pytest
import torch

from kvserve.kernels.write_kv import write_kv
from kvserve.kernels.fp8 import FP8_DTYPE, compute_kv_scale

SENTINEL = 7.0


def caches(dtype, num_blocks=6, block_size=8, heads=2, head_dim=64):
    k = torch.full((num_blocks, block_size, heads, head_dim), SENTINEL).to(dtype)
    return k, k.clone()


def tokens(n, heads=2, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, head_dim, generator=gen),
            torch.randn(n, heads, head_dim, generator=gen))


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_with_skipped_slots(backend, dtype):
    k_cache, v_cache = caches(dtype)
    key, value = tokens(10)
    key, value = key.to(dtype), value.to(dtype)
    slots = torch.tensor([3, 40, -1, 0, 47, 8, -1, 9, 21, 22])
    write_kv(key, value, k_cache, v_cache, slots, backend=backend)
    flat_k, flat_v = k_cache.view(48, 2, 64), v_cache.view(48, 2, 64)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[i]) and torch.equal(flat_v[slot], value[i])
    untouched = sorted(set(range(48)) - {s for s in slots.tolist() if s >= 0})
    assert bool((flat_k[untouched].float() == SENTINEL).all())
    assert bool((flat_v[untouched].float() == SENTINEL).all())


def test_fp32_tokens_are_cast_to_the_cache_dtype():
    k_cache, v_cache = caches(torch.bfloat16)
    key, value = tokens(3)
    write_kv(key, value, k_cache, v_cache, torch.tensor([5, 6, 7]))
    assert torch.equal(k_cache[0, 5:8], key.to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_fp8_round_trip_error_is_bounded(backend):
    k_cache, v_cache = caches(FP8_DTYPE)
    key, value = tokens(12)
    key = key * 30  # beyond e4m3's 3 mantissa bits, inside its range at this scale
    k_scale, v_scale = compute_kv_scale(key), compute_kv_scale(value)
    write_kv(key, value, k_cache, v_cache, torch.arange(12) * 4, k_scale, v_scale,
             backend=backend)
    back_k = k_cache.view(48, 2, 64)[::4].float() * k_scale
    back_v = v_cache.view(48, 2, 64)[::4].float() * v_scale
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus half a subnormal step (2^-10).
    assert bool(((back_k - key).abs() <= key.abs() / 16 + k_scale * 2**-10).all())
    assert bool(((back_v - value).abs() <= value.abs() / 16 + v_scale * 2**-10).all())
    assert (back_k - key).abs().max() > 0  # it really is quantised


def test_fp8_clamps_values_past_the_range():
    k_cache, v_cache = caches(FP8_DTYPE)
    key = torch.full((1, 2, 64), 1000.0)
    write_kv(key, -key, k_cache, v_cache, torch.tensor([0]), 1.0, 1.0)
    assert float(k_cache[0, 0].float().min()) == 448.0
    assert float(v_cache[0, 0].float().max()) == -448.0


def test_compute_kv_scale_leaves_headroom():
    x = torch.tensor([[-3.0, 50.0], [2.0, 1.0]])
    scale = compute_kv_scale(x)
    assert abs(50.0 / scale - 200.0) < 1e-3
    assert compute_kv_scale(torch.zeros(4)) > 0
    with pytest.raises(ValueError, match="headroom"):
        compute_kv_scale(x, headroom=0.5)


def test_fp8_bytes_widen_exactly_for_every_code():
    from kvserve.kernels.fp8_cpu import FP8_TO_FP16_FACTOR, fp8_bytes_to_fp16

    codes = torch.arange(256, dtype=torch.uint8)
    truth = codes.view(FP8_DTYPE).float()
    widened = fp8_bytes_to_fp16(codes).float() * FP8_TO_FP16_FACTOR
    finite = ~truth.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(widened[finite], truth[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_copy_of_strided_qkv_views_equals_the_reference(dtype):
    """The model writes k and v as views into one fused qkv output (row stride > width); the
    C++ row copy must take them, skip negative slots and match the reference write."""
    from kvserve.kernels import cpu_ops

    assert cpu_ops.fused_available()
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(10, 6 * 64, generator=gen).to(dtype)
    key = qkv[:, 2 * 64:4 * 64].view(10, 2, 64)
    value = qkv[:, 4 * 64:].view(10, 2, 64)
    assert not key.is_contiguous()
    slots = torch.tensor([3, 40, -1, 0, 47, 8, -1, 9, 21, 22])
    k_cache, v_cache = caches(dtype)
    k_ref, v_ref = caches(dtype)
    assert cpu_ops.fused_write_kv(key, value, k_cache, v_cache, slots)
    write_kv(key, value, k_ref, v_ref, slots, backend="reference")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # rows of another dtype than the cache are not the fused copy's: the torch path casts them
    assert not cpu_ops.fused_write_kv(key.float() if dtype != torch.float32 else key.double(),
                                      value, k_cache, v_cache, slots)


@pytest.mark.parametrize("backend", ["torch", "reference", "auto"])
def test_rope_write_kv_declines_off_the_triton_path(backend):
    """On the CPU's backends the fused RoPE write declines and writes nothing: the layer then
    rotates k itself and calls write_kv (the Triton path: tests/unit/engine/worker/
    test_gpu_step.py and test_triton_fused.py)."""
    from kvserve.kernels.write_kv import rope_write_kv

    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    assert rope_write_kv(k, v, cos, sin, kc, vc, torch.tensor([0, 5, 7]), backend=backend) is False
    assert not kc.any() and not vc.any()

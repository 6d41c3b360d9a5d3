"""The fused C++ elementwise ops (csrc/cpu_ops.cpp) against their torch expressions."""

import pytest
import torch

from kvserve.kernels import cpu_ops

TOL = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def fused_ops_built():
    assert cpu_ops.fused_available(), "the C++ ops did not build on a machine with a compiler"


def _close(got, expected, dtype):
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_and_fused_residual_add(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    res = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    _close(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.torch_rms_norm(x, w, 1e-5), dtype)

    expected_sum = x + res
    expected = cpu_ops.torch_rms_norm(expected_sum, w, 1e-5)
    res_in = res.clone()
    out, new_res = cpu_ops.add_rms_norm(x, res_in, w, 1e-5)
    assert new_res.data_ptr() == res_in.data_ptr()  # the residual stream is updated in place
    _close(new_res, expected_sum, dtype)
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_over_the_whole_range(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, 2 * 1536, generator=gen) * 6
    x[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-8, -1e-8])
    x = x.to(dtype)
    got = cpu_ops.silu_and_mul(x)
    assert torch.isfinite(got).all()
    _close(got, cpu_ops.torch_silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_rope_in_place_on_views_of_the_fused_qkv_output(dtype, head_dim):
    """q and k are strided views into one [T, (Hq + 2 Hk) D] matmul output, as in the model."""
    gen = torch.Generator().manual_seed(head_dim)
    t, hq, hk = 19, 9, 3
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(t, hq, head_dim), k.view(t, hk, head_dim)
    angles = torch.rand(t, head_dim // 2, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = cpu_ops.torch_rope(q, cos, sin), cpu_ops.torch_rope(k, cos, sin)
    v_before = v.clone()
    got_q, got_k = cpu_ops.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _close(got_q, expected_q, dtype)
    _close(got_k, expected_k, dtype)
    assert torch.equal(v, v_before)  # the V part of the buffer is not touched


def test_bad_shapes_are_errors_not_silent_garbage():
    x = torch.randn(4, 576)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.kvserve_ops.rms_norm(x, torch.ones(575), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.kvserve_ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="cos/sin"):
        q = torch.randn(4, 2, 64)
        torch.ops.kvserve_ops.rotary_embedding(q, q.clone(), torch.ones(4, 31), torch.ones(4, 31))


def test_disabled_fused_ops_use_the_torch_expressions(monkeypatch):
    monkeypatch.setenv("KVSERVE_FUSED_OPS", "0")
    cpu_ops.fused_available.cache_clear()
    try:
        x = torch.randn(3, 64)
        w = torch.rand(64)
        assert not cpu_ops.fused_available()
        assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.torch_rms_norm(x, w, 1e-6))
    finally:
        cpu_ops.fused_available.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torch_argmax_on_ties_nan_and_inf(dtype):
    """First index of the max on ties (bf16 logits are full of them), the first NaN of a row
    with NaNs, 0 for a row of -inf; rows of a wider tensor (a stride > width) too."""
    gen = torch.Generator().manual_seed(3)
    wide = (torch.randn(9, 5000, generator=gen) * 4).to(dtype)
    x = wide[:, :4099]
    x[0, 4000] = x[0, 17] = x[0, 2048] = 1e4
    x[1, 3000] = x[1, 5] = float("nan")
    x[1, 0] = float("inf")
    x[2] = float("-inf")
    x[3, 4098] = float("inf")
    x[4] = 0.0
    x[5, :] = -1e30
    x[5, 4097] = -1e29
    got = cpu_ops.argmax(x)
    assert got.dtype == torch.int64 and got.shape == (9,)
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got[:6].tolist() == [17, 5, 0, 4098, 0, 4097]

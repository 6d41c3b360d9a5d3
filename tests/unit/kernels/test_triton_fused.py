"""The fused Triton elementwise kernels (kernels/triton_fused.py) under TRITON_INTERPRET=1 on
CPU tensors, against the torch expressions the layers run on the CPU."""

import pytest
import torch
from conftest import triton_interpreted
import torch.nn.functional as F

from kvserve.engine.layers.layernorm import GemmaRMSNorm
from kvserve.kernels.cpu_ops import torch_rms_norm, torch_rope, torch_silu_and_mul

# The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: one bf16 ulp (2^-7
# relative) per rounding, and the torch expressions round at one or two more points.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def fused():
    with triton_interpreted("kvserve.kernels.triton_fused") as (module,):
        yield module


def _x(shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a width that is not a power of two
def test_add_rms_norm_matches_llama_norm(fused, dtype, hidden):
    x, res, w = _x((5, hidden), dtype, 1), _x((5, hidden), dtype, 2), _x((hidden,), dtype, 3)
    want_res = x + res
    want = torch_rms_norm(want_res, w, 1e-6)
    got = fused.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, want_res, **TOL[dtype])  # the residual, updated in place
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(fused.add_rms_norm(x, None, w, 1e-6),
                               torch_rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_gemma_scales_by_one_plus_weight(fused, dtype):
    norm = GemmaRMSNorm(80, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(_x((80,), dtype, 4))
    x, res = _x((3, 80), dtype, 5), _x((3, 80), dtype, 6)
    want, want_res = norm(x, res.clone())
    got = fused.add_rms_norm(x, res, norm.weight, 1e-6, gemma=True)
    torch.testing.assert_close(res, want_res, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])
    # The (1 + w) variant differs from the plain one, so the flag is what picks it.
    assert not torch.allclose(got.float(), torch_rms_norm(want_res, norm.weight, 1e-6).float(),
                              atol=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])  # 1500: more than one column block per row
def test_silu_and_mul(fused, dtype, inter):
    x = _x((4, 2 * inter), dtype, 7)
    torch.testing.assert_close(fused.act_and_mul(x, "silu"), torch_silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(fused, dtype):
    x = _x((4, 2 * 72), dtype, 8) * 3
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up  # the GatedMLP's gelu_tanh expression
    torch.testing.assert_close(fused.act_and_mul(x, "gelu_tanh"), want, **TOL[dtype])
    with pytest.raises(ValueError, match="activation"):
        fused.act_and_mul(x, "relu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_qkv_views(fused, dtype):
    t, hq, hk, d = 6, 4, 2, 32
    qkv = _x((t, (hq + 2 * hk) * d), dtype, 9)
    q = qkv[:, :hq * d].view(t, hq, d)  # views into the fused qkv output, as the model has
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    angles = _x((t, d // 2), torch.float32, 10)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = torch_rope(q, cos, sin), torch_rope(k, cos, sin)
    v_before = qkv[:, (hq + hk) * d:].clone()
    got_q, got_k = fused.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v untouched


def test_empty_batches(fused):
    x = torch.empty(0, 64)
    assert fused.add_rms_norm(x, None, torch.ones(64), 1e-6).shape == (0, 64)
    assert fused.act_and_mul(torch.empty(0, 32)).shape == (0, 16)


@pytest.fixture
def triton_path(fused, monkeypatch):
    """The layers' CUDA branch, taken on CPU tensors: use_triton says yes, the C++ ops no."""
    from kvserve.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(cpu_ops, "_fused", lambda x: False)
    calls = []
    for name in ("add_rms_norm", "act_and_mul"):  # count the launches: the branch is taken
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _n=name, **k:
                            calls.append(_n) or _real(*a, **k))
    monkeypatch.setattr(cpu_ops, "calls", calls, raising=False)
    return cpu_ops


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_layers_take_the_triton_kernels_behind_the_device_check(triton_path, activation):
    from kvserve.engine.layers.layernorm import RMSNorm
    from kvserve.engine.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, False, None, torch.float32, "cpu", activation=activation)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    norm, gemma = RMSNorm(32, 1e-6, torch.float32), GemmaRMSNorm(32, 1e-6, torch.float32)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(gemma.weight)
    x, res = _x((5, 32), torch.float32, 11), _x((5, 32), torch.float32, 12)
    with torch.no_grad():
        got = [mlp(x), norm(x), *norm(x, res.clone()), gemma(x), *gemma(x, res.clone())]
        assert triton_path.calls == ["act_and_mul"] + ["add_rms_norm"] * 4
        triton_path.use_triton = lambda x: False  # monkeypatch restores it afterwards
        want = [mlp(x), norm(x), *norm(x, res.clone()), gemma(x), *gemma(x, res.clone())]
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **TOL[torch.float32], msg=lambda m: f'{i}: {m}')


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_the_kv_write(fused, dtype):
    """rope_write_kv stores rope(k) and v where write_kv would store them; slot -1 skips."""
    from kvserve.kernels.write_kv import write_kv

    t, hk, d, blocks, bs = 5, 2, 32, 4, 4
    k, v = _x((t, hk, d), dtype, 13), _x((t, hk, d), dtype, 14)
    angles = _x((t, d // 2), torch.float32, 15)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([3, 9, -1, 0, 14])
    got_k, got_v = torch.zeros(blocks, bs, hk, d, dtype=dtype), torch.zeros(blocks, bs, hk, d,
                                                                            dtype=dtype)
    want_k, want_v = got_k.clone(), got_v.clone()
    fused.rope_write_kv(k, v, cos, sin, got_k, got_v, slots)
    write_kv(torch_rope(k, cos, sin), v, want_k, want_v, slots, backend="torch")
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(got_v, want_v)  # copied, not rounded
    assert got_k.flatten(0, 1)[[1, 2, 4, 5]].abs().sum() == 0  # untouched slots stay zero

"""The fused MoE kernel (kernels/triton_moe.py) under TRITON_INTERPRET=1 on CPU tensors:
align_block_size against a plain loop, and the experts' matmuls in every weight format (dense,
W4A16 symmetric / asymmetric / act order, W8A16, FP8 per channel and block, int8 and fp8
activations) against x @ dequantised W^T, expert by expert, with tolerances that a wrong nibble,
group, scale or expert exceeds many times over."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_interpreted
from kvserve.engine.layers.moe import MoESpec, fused_experts, route
from kvserve.engine.layers.quantization.activation import (
    FP8_MAX,
    ActivationScheme,
    torch_int8_per_token,
)
from kvserve.engine.layers.quantization.qweight import QuantizedWeight

E, K_TOP, H, I = 4, 2, 96, 40  # H = 96: a K loop with a partial tile; 2I = 80: partial N tiles


@pytest.fixture(scope="module")
def kern():
    with triton_interpreted("kvserve.kernels.triton_moe", "kvserve.kernels.triton_fused") as m:
        yield m[0]


def reference_align(ids: torch.Tensor, num_experts: int, block_m: int):
    """The padded, expert-sorted pair list as a plain loop over experts."""
    flat = ids.reshape(-1).tolist()
    rows, blocks = [], []
    for e in range(num_experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        if not mine:
            continue
        pad = -len(mine) % block_m
        rows += mine + [len(flat)] * pad
        blocks += [e] * ((len(mine) + pad) // block_m)
    return rows, blocks


@pytest.mark.parametrize("case", ["idle_experts", "one_token", "one_expert", "many"])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size_matches_a_plain_loop(kern, case, block_m):
    gen = torch.Generator().manual_seed(block_m)
    ids = {"idle_experts": torch.tensor([[0, 3], [3, 5], [0, 5], [5, 3]]),  # 1, 2, 4 idle
           "one_token": torch.tensor([[4, 1]]),
           "one_expert": torch.full((5, 1), 2),
           "many": torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(41)])}[case]
    sorted_pairs, block_expert, used = kern.align_block_size(ids, 6, block_m)
    rows, blocks = reference_align(ids, 6, block_m)
    nb = kern.max_blocks(ids.numel(), 6, block_m)
    assert sorted_pairs.shape == (nb * block_m,) and block_expert.shape == (nb,)
    assert sorted_pairs[:len(rows)].tolist() == rows
    assert (sorted_pairs[len(rows):] == ids.numel()).all()  # the sentinel pads the rest
    assert block_expert[:len(blocks)].tolist() == blocks
    assert (block_expert[len(blocks):] == -1).all()
    assert used.tolist() == [len(blocks)]


# ---- the experts' weights in each format ---------------------------------------------------
def int_weight(gen, out: int, inp: int, bits: int, group: int, asym: bool,
               act_order: bool = False) -> QuantizedWeight:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(lo, hi + 1, (out, inp), generator=gen, dtype=torch.int8)
    groups = -(-inp // group)
    scale = torch.rand(out, groups, generator=gen) * 0.05 + 0.01
    zero = torch.randint(lo, hi + 1, (out, groups), generator=gen, dtype=torch.int8) \
        if asym else None
    g_idx = (torch.randperm(inp, generator=gen) // group).to(torch.int32) if act_order else None
    return QuantizedWeight(values, scale, zero, group, bits, g_idx)


def fp8_weight(gen, out: int, inp: int, block: int | None) -> QuantizedWeight:
    values = (torch.randn(out, inp, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    if block is None:  # per channel
        return QuantizedWeight(values, torch.rand(out, 1, generator=gen) * 0.01 + 1e-3, None,
                               inp, 8)
    blocks = torch.rand(-(-out // block), -(-inp // block), generator=gen) * 0.01 + 1e-3
    return QuantizedWeight(values, blocks.repeat_interleave(block, 0)[:out].contiguous(), None,
                           block, 8)


FORMATS = {
    "w4a16_sym": lambda g, o, i: int_weight(g, o, i, 4, 32, False),
    "w4a16_asym": lambda g, o, i: int_weight(g, o, i, 4, 32, True),
    "w4a16_act_order": lambda g, o, i: int_weight(g, o, i, 4, 8, True, act_order=True),
    "w8a16": lambda g, o, i: int_weight(g, o, i, 8, i, False),
    "w8a16_zero": lambda g, o, i: int_weight(g, o, i, 8, i, True),
    "fp8_channel": lambda g, o, i: fp8_weight(g, o, i, None),
    "fp8_block": lambda g, o, i: fp8_weight(g, o, i, 16),
}
ACTIVATIONS = {"w8a8_int8": ("w8a16", "int8"), "fp8_dynamic": ("fp8_channel", "fp8")}


def experts_of(fmt: str, seed: int = 0) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
    gen = torch.Generator().manual_seed(seed)
    make = FORMATS[fmt]
    return [make(gen, 2 * I, H) for _ in range(E)], [make(gen, H, I) for _ in range(E)]


def routing(tokens: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    logits[:, 3] = -30.0  # expert 3 gets no token
    weights, ids = route(logits, K_TOP, True)
    return x, weights, ids


def fake_quant(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """x as the kernel sees it: rounded per token through int8 / fp8 (the same torch ops)."""
    if kind is None:
        return x
    if kind == "int8":
        codes, scale = torch_int8_per_token(x)
        return codes.float() * scale
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).eps)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def reference_layer(x, ws13, ws2, weights, ids, kind=None, dtype=torch.float64):
    """Pair by pair: x (rounded as the scheme says) through the dequantised experts."""
    out = torch.zeros(x.shape[0], H, dtype=dtype)
    for t in range(x.shape[0]):
        for j in range(K_TOP):
            e = int(ids[t, j])
            h = fake_quant(x[t:t + 1], kind).to(dtype) @ ws13[e].dequantize(dtype).t()
            h = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            h = fake_quant(h.float(), kind).to(dtype)
            out[t] += float(weights[t, j]) * (h @ ws2[e].dequantize(dtype).t())[0]
    return out


SPEC = MoESpec(num_experts=E, top_k=K_TOP, hidden=H, intermediate=I, renormalize=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("fmt", [*FORMATS, *ACTIVATIONS])
@pytest.mark.parametrize("tokens", [1, 13])
def test_quantised_experts_match_the_dequantised_reference(kern, fmt, tokens):
    from kvserve.engine.layers.moe_gpu import StackedExperts, gpu_experts

    base, kind = ACTIVATIONS.get(fmt, (fmt, None))
    ws13, ws2 = experts_of(base)
    act = ActivationScheme(kind) if kind else None
    x, weights, ids = routing(tokens)
    got = gpu_experts(x, StackedExperts(ws13, act), StackedExperts(ws2, act), weights, ids, SPEC)
    want = reference_layer(x, ws13, ws2, weights, ids, kind)
    # fp32 throughout; activation-quantised: a code may round the other way (1 ulp of 127)
    assert rel_err(got, want) < (1e-5 if kind is None else 2e-3), rel_err(got, want)
    if tokens > 1:  # the tolerance is one a wrong expert, group or nibble fails by far
        wrong = reference_layer(x, ws13[1:] + ws13[:1], ws2, weights, ids, kind)
        assert rel_err(wrong, want) > 100 * max(rel_err(got, want), 1e-6)


def test_a_wrong_group_or_nibble_is_caught(kern):
    """The tolerance above against the smallest faults: one group's scale, one code."""
    from kvserve.engine.layers.moe_gpu import StackedExperts, gpu_experts

    ws13, ws2 = experts_of("w4a16_asym")
    x, weights, ids = routing(13)
    got = gpu_experts(x, StackedExperts(ws13, None), StackedExperts(ws2, None), weights, ids,
                      SPEC)
    e = int(ids[0, 0])
    for fault in ("scale", "code"):
        bad = list(ws13)
        w = bad[e]
        if fault == "scale":
            scale = w.scale.clone()
            scale[:, 1] *= 1.5
            bad[e] = QuantizedWeight(w.values, scale, w.zero, w.group_size, 4)
        else:
            values = w.values.clone()
            values[5, 7] = (int(values[5, 7]) + 5 + 8) % 16 - 8
            bad[e] = QuantizedWeight(values, w.scale, w.zero, w.group_size, 4)
        assert rel_err(got, reference_layer(x, bad, ws2, weights, ids)) > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_dense_experts_match_fused_experts(kern, dtype, activation):
    """The stacked dense weights read in place, with gpt-oss's biases and clamped SwiGLU."""
    from dataclasses import replace

    from kvserve.engine.layers.moe_gpu import gpu_experts

    spec = replace(SPEC, activation=activation, expert_bias=activation != "silu")
    gen = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * 0.2).to(dtype)
    b13 = (torch.randn(E, 2 * I, generator=gen) * 0.2).to(dtype) if spec.expert_bias else None
    b2 = (torch.randn(E, H, generator=gen) * 0.2).to(dtype) if spec.expert_bias else None
    for tokens in (1, 13):
        x, weights, ids = routing(tokens, seed=tokens)
        x = x.to(dtype)
        got = gpu_experts(x, w13, w2, weights, ids, spec, b13, b2)
        assert got.dtype == dtype
        want = fused_experts(x.double(), w13.double(), w2.double(), weights, ids, spec,
                             None if b13 is None else b13.double(),
                             None if b2 is None else b2.double())
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1.5e-2)


def test_no_tokens_and_all_on_one_expert(kern):
    from kvserve.engine.layers.moe_gpu import gpu_experts

    gen = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    x = torch.randn(40, H, generator=gen)
    ids = torch.stack((torch.full((40,), 2), torch.full((40,), 0)), 1)
    weights = torch.rand(40, 2, generator=gen)
    got = gpu_experts(x, w13, w2, weights, ids, SPEC)
    want = fused_experts(x.double(), w13.double(), w2.double(), weights, ids, SPEC)
    assert rel_err(got, want) < 1e-5
    assert gpu_experts(x[:0], w13, w2, weights[:0], ids[:0], SPEC).shape == (0, H)

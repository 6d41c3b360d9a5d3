"""FusedMoE.forward on the GPU's branch (the fused Triton experts kernel, forced on CPU tensors
and interpreted) against the same layer on the CPU's branch: dense experts with a shared expert,
gpt-oss's biases and clamped SwiGLU, a tensor-parallel rank's slice, bf16; and quantised experts
(--quantization int8 / fp8: per-token activations) stacked from the same QuantizedWeights the
per-expert kernels are built from."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import triton_interpreted
from kvserve.engine.layers import moe
from kvserve.engine.layers.moe import FusedMoE
from kvserve.engine.layers.quantization.online import OnlineConfig
from kvserve.engine.layers.quantization.quant_linear import QuantLinear
from kvserve.kernels import cpu_ops
from test_moe import SPEC, OneRank, build, inputs, random_experts


@pytest.fixture(scope="module")
def interpreted():
    with triton_interpreted("kvserve.kernels.triton_moe", "kvserve.kernels.triton_fused"):
        yield


def forced(monkeypatch, layer: FusedMoE, x: torch.Tensor, on: bool) -> torch.Tensor:
    """layer(x) with the CUDA switch (cpu_ops.use_triton) forced on or off; counts fused calls."""
    calls = []
    real = moe.gpu_experts
    monkeypatch.setattr(cpu_ops, "use_triton", lambda t: on)
    monkeypatch.setattr(moe, "gpu_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out = layer(x)
    assert bool(calls) == on
    return out


CASES = {
    "plain": {},
    "shared": {"shared_intermediate": 16, "top_k": 3},
    "gpt_oss": {"renormalize": True, "router_bias": True, "expert_bias": True,
                "activation": "swiglu_clamped", "swiglu_limit": 0.7},
}


@pytest.mark.parametrize("case", [*CASES, "tp_rank1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gpu_branch_equals_the_cpu_branch(interpreted, monkeypatch, case, dtype):
    spec = replace(SPEC, **CASES.get(case, CASES["gpt_oss"]))
    gen, x, router = inputs(spec, tokens=21, seed=7)
    router[[1, 4]] = -5.0  # experts 1 and 4 idle
    x = x.abs()
    bias = spec.router_bias
    router_b = torch.randn(spec.num_experts, generator=gen) if bias else None
    experts = random_experts(spec, gen, bias=spec.expert_bias)
    shared = None
    if spec.shared_intermediate:
        n = spec.shared_intermediate
        shared = ((torch.randn(n, 32, generator=gen), torch.randn(n, 32, generator=gen),
                   torch.randn(32, n, generator=gen)), torch.randn(32, generator=gen))
    tp = OneRank(1) if case == "tp_rank1" else None
    layer = build(spec, experts, router, router_b, shared, tp=tp)
    for rows in (x, x[:1]):
        exact = forced(monkeypatch, layer, rows, on=False)  # fp32, the CPU's branch
        low = copy.deepcopy(layer).to(dtype)
        want = forced(monkeypatch, low, rows.to(dtype), on=False)
        got = forced(monkeypatch, low, rows.to(dtype), on=True)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # each branch rounds h and the outputs to bf16 at its own points (the
            # interpreter truncates): as near the fp32 result as the CPU's branch is
            err = float((got.float() - exact).norm() / exact.norm())
            assert err < 2 * float((want.float() - exact).norm() / exact.norm()) + 2e-3, err


def quantised_layer(scheme: str, stacked: bool) -> FusedMoE:
    """SPEC's layer with --quantization `scheme`'s experts (one QuantLinear each, loaded from
    the same random dense weights), finished in the GPU's form (stacked) or the CPU's."""
    spec = SPEC
    gen, _, router = inputs(spec, seed=3)
    experts = random_experts(spec, gen)
    layer = FusedMoE(spec, None, torch.float32)
    method = OnlineConfig(scheme).method
    e, i, h = spec.num_experts, spec.intermediate, spec.hidden
    layer.quantize_experts(
        [QuantLinear(method, [f"e{n}.gate", f"e{n}.up"], h, 2 * i, None, torch.float32)
         for n in range(e)],
        [QuantLinear(method, [f"e{n}.down"], i, h, None, torch.float32) for n in range(e)])
    with torch.no_grad():
        layer.gate.weight.copy_(router)
    for n, ex in enumerate(experts):
        for proj in ("gate", "up", "down"):
            layer.load_expert(n, proj, getattr(ex, proj), f"e{n}.{proj}")
    moe_stack_on = moe.stack_on
    moe.stack_on = lambda device: stacked
    try:
        layer.finish_experts(torch.device("cpu"))
    finally:
        moe.stack_on = moe_stack_on
    return layer


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantised_gpu_branch_equals_the_per_expert_kernels(interpreted, scheme):
    """Stacked experts (the fused kernel, activations quantised per token with torch) against
    each expert's own kernel (oneDNN int8 / the dequantising fp8 matmul) on the same weights."""
    _, x, _ = inputs(SPEC, tokens=19, seed=8)
    per_expert, fused = quantised_layer(scheme, False), quantised_layer(scheme, True)
    assert fused.w13_stacked is not None and per_expert.w13_stacked is None
    assert all(lin.kernel is None for lin in fused.w13)
    with torch.no_grad():
        want, got = per_expert(x), fused(x)
    err = float((got - want).norm() / want.norm())
    assert err < 5e-3, err  # per-token codes of equal inputs: the same up to float rounding

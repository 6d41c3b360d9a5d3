"""The fused MoE layer against a naive per-token reference: routing (renormalised or not),
experts that get no token, the grouped matmul and its per-expert fallback, the shared expert's
sigmoid gate, gpt-oss's biases and clamped SwiGLU, loading, and a tensor-parallel split."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.errors import ModelNotFoundError
from kvserve.engine.layers import moe
from kvserve.engine.layers.moe import FusedMoE, MoESpec, route

SPEC = MoESpec(num_experts=6, top_k=2, hidden=32, intermediate=24, renormalize=False)


@dataclass
class Expert:
    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


def random_experts(spec: MoESpec, gen: torch.Generator, bias: bool = False) -> list[Expert]:
    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    i, h = spec.intermediate, spec.hidden
    return [Expert(r(i, h), r(i, h), r(h, i), *((r(i), r(i), r(h)) if bias else ()))
            for _ in range(spec.num_experts)]


def naive(x: torch.Tensor, router: torch.Tensor, router_b, experts: list[Expert],
          spec: MoESpec, shared=None) -> torch.Tensor:
    """Token by token: softmax over all experts, the top k, each expert as plain linears."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.linear(x[t], router, router_b).softmax(-1)
        w, ids = probs.topk(spec.top_k)
        if spec.renormalize:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), ids.tolist()):
            ex = experts[e]
            g, u = F.linear(x[t], ex.gate, ex.b_gate), F.linear(x[t], ex.up, ex.b_up)
            if spec.activation == "silu":
                act = F.silu(g) * u
            else:
                g, u = g.clamp(max=spec.swiglu_limit), u.clamp(-spec.swiglu_limit,
                                                                spec.swiglu_limit)
                act = (u + 1) * g * torch.sigmoid(spec.swiglu_alpha * g)
            out[t] += weight * F.linear(act, ex.down, ex.b_down)
        if shared is not None:
            (sg, su, sd), sgate = shared
            out[t] += torch.sigmoid(sgate @ x[t]) * F.linear(F.silu(sg @ x[t]) * (su @ x[t]), sd)
    return out


def build(spec: MoESpec, experts: list[Expert], router, router_b=None, shared=None,
          tp=None) -> FusedMoE:
    layer = FusedMoE(spec, tp, torch.float32)
    with torch.no_grad():
        layer.gate.weight.copy_(router)
        if router_b is not None:
            layer.gate.bias.copy_(router_b)
    for e, ex in enumerate(experts):
        for proj in ("gate", "up", "down"):
            layer.load_expert(e, proj, getattr(ex, proj), f"experts.{e}.{proj}")
    if spec.expert_bias:  # only gpt-oss has them, in its stacked interleaved layout
        gu = torch.stack([torch.stack((ex.gate.T, ex.up.T), -1).flatten(-2) for ex in experts])
        gub = torch.stack([torch.stack((ex.b_gate, ex.b_up), -1).flatten() for ex in experts])
        layer.load_stacked("gate_up_proj", gu, "gate_up_proj")
        layer.load_stacked("gate_up_proj_bias", gub, "gate_up_proj_bias")
        layer.load_stacked("down_proj", torch.stack([ex.down.T for ex in experts]), "down_proj")
        layer.load_stacked("down_proj_bias", torch.stack([ex.b_down for ex in experts]), "bias")
    if shared is not None:
        (sg, su, sd), sgate = shared
        n, r = (tp.size, tp.rank) if tp is not None else (1, 0)
        i = sg.shape[0] // n
        with torch.no_grad():
            layer.shared_expert.gate_up_proj.weight.copy_(
                torch.cat((sg[r * i:(r + 1) * i], su[r * i:(r + 1) * i])))
            layer.shared_expert.down_proj.weight.copy_(sd[:, r * i:(r + 1) * i])
            layer.shared_expert_gate.weight.copy_(sgate.unsqueeze(0))
    return layer


def inputs(spec: MoESpec, tokens: int = 37, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, spec.hidden, generator=gen)
    router = torch.randn(spec.num_experts, spec.hidden, generator=gen)
    return gen, x, router


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert_mm"])
def test_matches_naive_reference_with_idle_experts(monkeypatch, renormalize, grouped):
    spec = replace(SPEC, renormalize=renormalize)
    gen, x, router = inputs(spec)
    x = x.abs()  # positive inputs, and experts 1 and 4 have all-negative router rows:
    router[[1, 4]] = -5.0  # no token ever picks them
    experts = random_experts(spec, gen)
    if not grouped:
        monkeypatch.setattr(moe, "_grouped_mm_works", lambda *_: False)
    layer = build(spec, experts, router)
    _, ids = route(layer.gate(x), spec.top_k, spec.renormalize)
    counts = torch.bincount(ids.flatten(), minlength=spec.num_experts)
    assert counts[1] == counts[4] == 0 and (counts > 0).sum() >= 3
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, naive(x, router, None, experts, spec), atol=1e-5, rtol=1e-5)


def test_route_weights_are_softmax_over_all_or_the_chosen():
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0]])
    w, ids = route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)[0]
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(w[0], probs[[0, 2]])
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w[0], probs[[0, 2]] / probs[[0, 2]].sum())


def test_one_token_and_every_token_on_one_expert():
    gen, x, router = inputs(SPEC, tokens=9, seed=3)
    router[2] = 50.0 * x.mean(0)  # expert 2 wins for every token
    experts = random_experts(SPEC, gen)
    layer = build(SPEC, experts, router)
    with torch.no_grad():
        for rows in (x[:1], x):
            torch.testing.assert_close(layer(rows), naive(rows, router, None, experts, SPEC),
                                       atol=1e-5, rtol=1e-5)


def test_shared_expert_with_sigmoid_gate():
    spec = replace(SPEC, shared_intermediate=40, top_k=3)
    gen, x, router = inputs(spec, seed=1)
    experts = random_experts(spec, gen)
    shared = ((torch.randn(40, 32, generator=gen) * 0.3, torch.randn(40, 32, generator=gen) * 0.3,
               torch.randn(32, 40, generator=gen) * 0.3), torch.randn(32, generator=gen))
    layer = build(spec, experts, router, shared=shared)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), naive(x, router, None, experts, spec, shared),
                                   atol=1e-5, rtol=1e-5)


def test_gpt_oss_biases_and_clamped_swiglu():
    spec = replace(SPEC, renormalize=True, router_bias=True, expert_bias=True,
                   activation="swiglu_clamped", swiglu_limit=0.7)  # low: the clamp bites
    gen, x, router = inputs(spec, seed=2)
    router_b = torch.randn(spec.num_experts, generator=gen)
    experts = random_experts(spec, gen, bias=True)
    layer = build(spec, experts, router, router_b)
    with torch.no_grad():
        got = layer(x)
        h = F.linear(x, experts[0].gate)
    assert (h > spec.swiglu_limit).any()
    torch.testing.assert_close(got, naive(x, router, router_b, experts, spec),
                               atol=1e-5, rtol=1e-5)


@dataclass
class OneRank:
    """A rank of a 2-way split with the all-reduce left to the test (it adds the two outputs)."""

    rank: int
    size: int = 2

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_two_ranks_hold_slices_that_sum_to_the_whole(gpt_oss):
    spec = replace(SPEC, shared_intermediate=0 if gpt_oss else 16)
    if gpt_oss:
        spec = replace(spec, renormalize=True, router_bias=True, expert_bias=True,
                       activation="swiglu_clamped")
    gen, x, router = inputs(spec, seed=4)
    router_b = torch.randn(spec.num_experts, generator=gen) if gpt_oss else None
    experts = random_experts(spec, gen, bias=gpt_oss)
    shared = None if gpt_oss else (
        (torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen),
         torch.randn(32, 16, generator=gen)), torch.randn(32, generator=gen))
    ranks = [build(spec, experts, router, router_b, shared, tp=OneRank(r)) for r in range(2)]
    assert ranks[0].w13.shape == (6, 24, 32) and ranks[1].w2.shape == (6, 32, 12)
    with torch.no_grad():
        total = ranks[0](x) + ranks[1](x)
    torch.testing.assert_close(total, naive(x, router, router_b, experts, spec, shared),
                               atol=1e-4, rtol=1e-4)


def test_bf16_stays_close_to_fp32():
    gen, x, router = inputs(SPEC, seed=5)
    experts = random_experts(SPEC, gen)
    layer = build(SPEC, experts, router)
    with torch.no_grad():
        ref = layer(x)
        got = layer.to(torch.bfloat16)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.05)


def test_mismatched_checkpoint_tensors_are_named():
    layer = FusedMoE(SPEC, None, torch.float32)
    with pytest.raises(ModelNotFoundError, match=r"experts.0.w1.*shape \(24, 31\).*\(24, 32\)"):
        layer.load_expert(0, "gate", torch.zeros(24, 31), "experts.0.w1")
    with pytest.raises(ModelNotFoundError, match="expert 6 is past the config's 6 experts"):
        layer.load_expert(6, "down", torch.zeros(32, 24), "experts.6.w2")

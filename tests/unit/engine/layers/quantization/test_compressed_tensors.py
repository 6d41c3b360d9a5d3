"""compressed-tensors checkpoints (written by compressed-tensors' own compressors) served
quantised: weight-only formats give the dequantised dense model's greedy tokens and logprobs
(as exactly as dense fp32 does); W8A8 int8 and FP8 with dynamic per-token activations agree with
transformers running the same checkpoint through compressed-tensors, teacher-forced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama, make_llm
from quant_checkpoints import PROMPTS, engine_greedy, hf_model, teacher_forced, write_quantized

from kvserve.engine.layers.quantization import QuantLinear


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ct") / "dense", seed=3)


def build(dense: Path, scheme: str) -> tuple[Path, Path]:
    base = dense.parent
    if not (base / scheme).exists():
        write_quantized(dense, base / scheme, scheme, base / f"{scheme}-ref")
    return base / scheme, base / f"{scheme}-ref"


def assert_matches_reference(llm, reference, atol: float) -> None:
    """Greedy tokens equal the reference's argmax at every step, logprobs within atol."""
    for prompt, (ids, logprobs) in zip(PROMPTS, engine_greedy(llm), strict=True):
        ref = teacher_forced(reference, prompt, ids)
        assert ids == ref.argmax(-1).tolist()
        got = torch.tensor(logprobs)
        want = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_BLOCK"])
def test_weight_only_schemes_match_the_dequantised_model(dense_dir, scheme):
    quant, ref = build(dense_dir, scheme)
    llm = make_llm(quant)
    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down of both layers; lm_head stays dense
    for lin in linears:  # kept quantised: fewer bytes than even a 16-bit dense weight
        held = sum(b.numel() * b.element_size() for b in lin.kernel.buffers())
        assert held < 2 * lin.in_features * lin.out_features
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


def test_symmetric_w4a16_also_matches_transformers_compressed_tensors(dense_dir):
    quant, _ = build(dense_dir, "W4A16")
    assert_matches_reference(make_llm(quant), hf_model(quant), atol=2e-4)


# The largest |logprob| gap of a chosen token to the fake-quantised reference, teacher-forced,
# measured 2026-12-07 on an AVX2 EPYC: int8 (W8A8) 0.0011 on the dense model, 0.060 on the
# Qwen3-MoE experts, 0.083 on the online-int8 Mixtral (a per-token code rounding the other way at
# a boundary); FP8_DYNAMIC 0.00001 or less everywhere. One layer's weight scales 5% off (the
# negative controls: the experts' alone on the MoE models) moved it to 0.38-4.95.
# FP8_DYNAMIC: the largest gap was under 0.01 on the AMD classes and 0.019 on the Sapphire
# Rapids class (fp8's 3-bit mantissa can turn a last-bit difference in an fp32 product before
# the per-token rounding into a whole code step after it); the 5% scale fault of the negative
# control gives 0.8-2.1.
LOGPROB_BOUND = {"W8A8": 0.15, "FP8_DYNAMIC": 0.03}


def teacher_forced_gaps(llm, hf_quant, hf_dense) -> tuple[float, float, float, float]:
    """Greedy tokens of `llm` against `hf_quant` (the fake-quantised reference) teacher-forced:
    (share that are its argmax, the largest |logprob gap| of a chosen token, the summed per-prompt
    largest gaps to hf_quant and to hf_dense, the exact model)."""
    llm.llm_engine.reset_prefix_cache()
    agree = total = 0
    worst = quant_err = dense_err = 0.0
    for prompt, (ids, logprobs) in zip(PROMPTS, engine_greedy(llm), strict=True):
        got, chosen = torch.tensor(logprobs), torch.tensor(ids)[:, None]
        ref_q = teacher_forced(hf_quant, prompt, ids)
        agree += int((ref_q.argmax(-1) == chosen[:, 0]).sum())
        total += len(ids)
        gap = float((got - ref_q.gather(1, chosen)[:, 0]).abs().max())
        worst, quant_err = max(worst, gap), quant_err + gap
        dense = teacher_forced(hf_dense, prompt, ids)
        dense_err += float((got - dense.gather(1, chosen)[:, 0]).abs().max())
    return agree / total, worst, quant_err, dense_err


def assert_near_fake_quantised(llm, hf_quant, hf_dense, scheme: str) -> None:
    """>= 90% of the greedy tokens are the fake-quantised reference's argmax, every chosen
    token's logprob is within the scheme's LOGPROB_BOUND of it, and nearer it than the exact
    model's (the activations really are rounded)."""
    agree, worst, quant_err, dense_err = teacher_forced_gaps(llm, hf_quant, hf_dense)
    assert agree >= 0.9, f"{agree:.0%} of the greedy tokens agree"
    assert worst < LOGPROB_BOUND[scheme], worst
    assert quant_err < dense_err


def scale_one_layers_weight_scales(llm, expert: bool, factor: float = 1.05) -> str:
    """The fault for the negative controls: every weight scale of one layer (only its experts', of
    the first layer with quantised experts, if `expert`) times `factor`, in place. Returns the
    layer's name."""
    named = list(llm.llm_engine.runner.model.named_buffers())
    scales = [(n, b) for n, b in named if n.endswith(("weight_scale", "kernel.scale"))
              and b.is_floating_point() and (not expert or ".mlp.w13." in n or ".mlp.w2." in n)]
    assert scales, "no weight scale buffer found"
    layer = scales[0][0].split(".mlp.")[0].split(".self_attn.")[0] + "."
    for name, buf in scales:
        if name.startswith(layer):
            buf.mul_(factor)
    return layer


def assert_fault_is_caught(llm, hf_quant, hf_dense, scheme: str, expert: bool = False) -> None:
    """Negative control: with one layer's weight scales (its experts', if `expert`) 5% off, the
    logprob bound fails."""
    name = scale_one_layers_weight_scales(llm, expert)
    _, worst, _, _ = teacher_forced_gaps(llm, hf_quant, hf_dense)
    assert worst >= LOGPROB_BOUND[scheme], (name, worst)


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
def test_activation_quantised_schemes_agree_with_transformers_teacher_forced(dense_dir, scheme):
    quant, ref = build(dense_dir, scheme)
    llm = make_llm(quant)
    hf_quant, hf_dense = hf_model(quant), hf_model(ref)
    assert_near_fake_quantised(llm, hf_quant, hf_dense, scheme)
    assert_fault_is_caught(llm, hf_quant, hf_dense, scheme)


def test_resident_weight_bytes_count_the_quantised_kernels(dense_dir):
    """The engine's weight figure (startup log, `kvserve:model_weight_bytes`) counts what the
    quantised kernels hold as buffers: the dense model's figure with each fp32 linear replaced by
    at least its int4 codes, and still less than the dense model. The quantised model keeps one
    copy of its tied lm_head (the embedding's), not the dense model's second, packed one."""
    from kvserve.engine.layers.packed_linear import PackedLinear
    from kvserve.engine.worker.kv_sizing import resident_weight_bytes

    quant, _ = build(dense_dir, "W4A16")
    model = make_llm(quant).llm_engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sizes = [lin.in_features * lin.out_features
             for lin in model.modules() if isinstance(lin, QuantLinear)]
    dense_model = make_llm(dense_dir).llm_engine.runner.model
    dense = resident_weight_bytes(dense_model)
    head_copy = dense_model.lm_head.packed_weight.nbytes \
        if isinstance(dense_model.lm_head, PackedLinear) else 0
    floor = dense - head_copy - sum(4 * n for n in sizes) + sum(n // 2 for n in sizes)
    assert floor <= resident_weight_bytes(model) < dense - head_copy

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


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
def test_activation_quantised_schemes_agree_with_transformers_teacher_forced(dense_dir, scheme):
    quant, ref = build(dense_dir, scheme)
    llm = make_llm(quant)
    hf_quant, hf_dense = hf_model(quant), hf_model(ref)
    agree = total = 0
    quant_err = dense_err = 0.0
    for prompt, (ids, logprobs) in zip(PROMPTS, engine_greedy(llm), strict=True):
        ref_q = teacher_forced(hf_quant, prompt, ids)
        agree += int((ref_q.argmax(-1) == torch.tensor(ids)).sum())
        total += len(ids)
        got = torch.tensor(logprobs)
        quant_err += float((got - ref_q.gather(1, torch.tensor(ids)[:, None])[:, 0]).abs().max())
        dense = teacher_forced(hf_dense, prompt, ids)
        dense_err += float((got - dense.gather(1, torch.tensor(ids)[:, None])[:, 0]).abs().max())
    assert agree / total >= 0.9, f"{agree}/{total} greedy tokens agree"
    # the activations really are rounded: closer to the fake-quantised model than to the dense
    assert quant_err < dense_err


def test_resident_weight_bytes_count_the_quantised_kernels(dense_dir):
    """The engine's weight figure (startup log, `kvserve:model_weight_bytes`) counts what the
    quantised kernels hold as buffers: the dense model's figure with each fp32 linear replaced by
    at least its int4 codes, and still less than the dense model. The quantised model keeps one
    copy of its tied lm_head (the embedding's), not the dense model's second, packed one."""
    from kvserve.engine.layers.packed_linear import PackedLinear
    from kvserve.engine.worker.platform import resident_weight_bytes

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

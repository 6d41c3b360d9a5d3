"""GPTQ, AWQ and native block-FP8 MoE checkpoints (Qwen3-MoE's gate_proj / up_proj / down_proj
experts, Mixtral's w1 / w3 / w2), written in each format's own layout by format_writers from a
tiny dense model (the router left dense, as those formats' tools leave it): every expert is
served quantised through the format's own LinearMethod and the greedy tokens and logprobs are the
dequantised dense model's. Also Qwen2-MoE's shared expert quantised, and --quantization int8|fp8
on a dense MoE checkpoint (per-channel weights, per-token activations)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_llm, triton_interpreted
from family_checks import build_family
from format_writers import set_quant_config, write_awq, write_fp8_block, write_gptq
from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.moe import ExpertLinears
from kvserve.engine.layers.quantization import QuantLinear
from quant_checkpoints import LINEARS, hf_model, write_quantized
from test_compressed_tensors import assert_matches_reference
from test_moe_experts import (
    assert_agrees_teacher_forced,
    assert_experts_stacked,
    assert_layer_matches_fake_quantised,
    moe_layers,
)

FAMILIES = {  # 4 experts of [64, 64], top 2; Qwen3-MoE's layer 0 dense, Mixtral's all sparse
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=64, mlp_only_layers=[0],
                                              norm_topk_prob=True, initializer_range=0.3)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size=64, initializer_range=0.3)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=64,
                                              shared_expert_intermediate_size=96,
                                              norm_topk_prob=False, initializer_range=0.3)),
}
WRITERS = {  # format -> writer(dense, out, reference)
    "gptq4_act_order": lambda d, o, r: write_gptq(d, o, 4, 32, True, False, r),
    "gptq8": lambda d, o, r: write_gptq(d, o, 8, -1, False, True, r),
    "awq": lambda d, o, r: write_awq(d, o, 32, r),
    "fp8_block": lambda d, o, r: write_fp8_block(d, o, 32, r),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            arch, overrides = FAMILIES[family]
            made[family] = build_family(tmp_path_factory.mktemp(family) / "dense", arch,
                                        **overrides)
        return made[family]

    return get


def quantised(dense_dir: Path, fmt: str) -> tuple[Path, Path]:
    out, ref = dense_dir.parent / fmt, dense_dir.parent / f"{fmt}-ref"
    if not out.exists():
        WRITERS[fmt](dense_dir, out, ref)
    return out, ref


def assert_experts_quantised(llm, expected_layers: int) -> None:
    layers = moe_layers(llm)
    assert len(layers) == expected_layers
    for moe in layers:
        assert isinstance(moe.w13, ExpertLinears) and isinstance(moe.w2, ExpertLinears)
        assert not isinstance(moe.gate, QuantLinear)  # the router stays dense
        for lin in [*moe.w13, *moe.w2]:  # kept quantised: under a 16-bit dense weight's bytes
            held = sum(b.numel() * b.element_size() for b in lin.kernel.buffers())
            assert held < 2 * lin.in_features * lin.out_features


@pytest.mark.parametrize("family,sparse", [("qwen3_moe", 2), ("mixtral", 3)])
@pytest.mark.parametrize("fmt", ["gptq4_act_order", "gptq8", "awq", "fp8_block"])
def test_experts_in_each_format_match_the_dequantised_model(dense, family, sparse, fmt):
    quant, ref = quantised(dense(family), fmt)
    llm = make_llm(quant)
    assert_experts_quantised(llm, sparse)
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


@pytest.fixture(scope="module")
def fused_kernel():
    with triton_interpreted("kvserve.kernels.triton_moe"):
        yield


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["gptq4_act_order", "gptq8", "awq", "fp8_block"])
def test_experts_stacked_for_the_fused_gpu_kernel(dense, fused_kernel, monkeypatch, family, fmt):
    """Each format's experts in the GPU's form (stacked at load, the fused Triton kernel reading
    GPTQ's shuffled g_idx, AWQ's zero points, FP8 block scales; forced here on the CPU)."""
    from kvserve.engine.layers import moe

    monkeypatch.setattr(moe, "stack_on", lambda device: True)
    quant, ref = quantised(dense(family), fmt)
    llm = make_llm(quant)
    assert_experts_stacked(llm)
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


def test_two_ranks_cut_act_order_experts_with_their_groups(dense):
    """GPTQ with shuffled g_idx over 2 ranks: each rank keeps 32 of every expert's 64 gate / up
    rows and 32 of down's 64 input columns, whose groups are scattered: their g_idx entries and
    every group's scales go with them."""
    quant, ref = quantised(dense("qwen3_moe"), "gptq4_act_order")
    llm = make_llm(quant, tensor_parallel_size=2)
    try:
        assert_matches_reference(llm, hf_model(ref), atol=2e-4)
    finally:
        llm.llm_engine.shutdown()


def test_awq_skipping_the_router_by_name_keeps_the_experts_gate_proj_quantised(dense, tmp_path):
    """modules_to_not_convert ["gate"] names the router (mlp.gate), not experts.N.gate_proj: a
    substring test would leave gate_proj dense beside a quantised up_proj."""
    import shutil

    quant, ref = quantised(dense("qwen3_moe"), "awq")
    shutil.copytree(quant, tmp_path / "q")
    set_quant_config(tmp_path / "q", modules_to_not_convert=["gate"])
    llm = make_llm(tmp_path / "q")
    assert_experts_quantised(llm, 2)
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


@pytest.mark.parametrize("fmt", ["gptq4_act_order", "W4A16"])
def test_qwen2_moe_shared_expert_is_served_quantised(dense, fmt):
    """The shared expert's gate / up / down quantised like the routed ones; its sigmoid gate
    (shared_expert_gate) and the router stay dense."""
    dense_dir = dense("qwen2_moe")
    if fmt == "W4A16":
        quant, ref = dense_dir.parent / fmt, dense_dir.parent / f"{fmt}-ref"
        if not quant.exists():
            write_quantized(dense_dir, quant, fmt, ref,
                            ignore=("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"))
    else:
        quant, ref = quantised(dense_dir, fmt)
    llm = make_llm(quant)
    assert_experts_quantised(llm, 3)
    for moe in moe_layers(llm):
        assert isinstance(moe.shared_expert.gate_up_proj, QuantLinear)
        assert isinstance(moe.shared_expert.down_proj, QuantLinear)
        assert not isinstance(moe.shared_expert_gate, QuantLinear)
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


def online_reference(dense_dir: Path, out: Path, scheme: str) -> Path:
    """`dense_dir` with every linear of LINEARS (experts included, router not) quantised per
    output channel as --quantization does (int8: absmax / 127, round; fp8: absmax / 448, cast to
    e4m3) and dequantised back."""
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(str(dense_dir / "model.safetensors"))
    for name, w in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            continue
        top = 127.0 if scheme == "int8" else 448.0
        scale = w.float().abs().amax(1, keepdim=True) / top
        if scheme == "int8":
            codes = torch.round(w.float() / scale).clamp(-127, 127)
        else:
            codes = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        state[name] = (codes * scale).to(w.dtype)
    shutil.copytree(dense_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("scheme,fake", [("int8", "W8A8"), ("fp8", "FP8_DYNAMIC")])
def test_online_quantization_of_a_dense_moe_checkpoint(dense, tmp_path, scheme, fake):
    """--quantization int8|fp8 on the dense Mixtral: every expert quantised per channel at load,
    its inputs per token; one layer equals HF's block on those weights with every expert input
    fake-quantised per token, and the greedy tokens agree teacher-forced."""
    dense_dir = dense("mixtral")
    llm = make_llm(dense_dir, quantization=scheme)
    ref = online_reference(dense_dir, tmp_path / "ref", scheme)
    assert_layer_matches_fake_quantised(moe_layers(llm)[1], ref, fake)
    assert_agrees_teacher_forced(llm, ref, fake)


def test_a_gptq_expert_missing_its_scales_is_named(dense, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    quant, _ = quantised(dense("mixtral"), "gptq8")
    shutil.copytree(quant, tmp_path / "q")
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    del state["model.layers.2.block_sparse_moe.experts.1.w3.scales"]
    save_file(state, str(tmp_path / "q" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError,
                       match=r"lacks model\.layers\.2\.block_sparse_moe\.experts\.1\.w3\.scales"):
        make_llm(tmp_path / "q")

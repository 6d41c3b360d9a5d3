"""Quantised MoE experts: a tiny Qwen3-MoE and a tiny Mixtral (transformers' own classes)
quantised by compressed-tensors' compressors, the router left dense as llm-compressor's ignore of
`mlp.gate` (Mixtral: `block_sparse_moe.gate`) leaves it, served with every expert's weight kept
quantised. Weight-only schemes give the greedy tokens and logprobs of the dense model holding the
dequantised weights; W8A8 int8 and FP8 with per-token activations agree, teacher-forced, with that
model whose linear and expert inputs are fake-quantised per token by compressed-tensors; tensor
parallelism cuts the experts' rows and groups with their scales. Mixtral's config names its
experts as its checkpoint does (block_sparse_moe.experts.N.w1 / w3 / w2)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_checks import build_family
from quant_checkpoints import SCHEMES, hf_model, write_quantized
from test_compressed_tensors import assert_fault_is_caught, assert_matches_reference, \
    assert_near_fake_quantised

from conftest import make_llm, triton_interpreted
from kvserve.engine.errors import ConfigError, QuantizationError
from kvserve.engine.layers import moe as moe_module
from kvserve.engine.layers.moe import ExpertLinears, FusedMoE
from kvserve.engine.layers.quantization import QuantLinear

IGNORE = ("lm_head", "re:.*mlp.gate$")  # llm-compressor's MoE recipes
MIXTRAL_IGNORE = ("lm_head", "re:.*block_sparse_moe.gate$")
# targets by the checkpoint's module names (as a mixed-precision recipe writes them): a Mixtral
# expert is only recognised under its own name, block_sparse_moe.experts.N.w1 / w3 / w2
MIXTRAL_TARGETS = (r"re:.*self_attn\.[qkvo]_proj$", r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    # layer 0 dense (mlp_only_layers), layers 1-2 sparse: 4 experts of [64, 64], top 2
    return build_family(tmp_path_factory.mktemp("qmoe") / "dense", "Qwen3MoeForCausalLM",
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        mlp_only_layers=[0], norm_topk_prob=True, initializer_range=0.3)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    # 3 sparse layers: 4 experts of [64, 64], top 2
    return build_family(tmp_path_factory.mktemp("qmixtral") / "dense", "MixtralForCausalLM",
                        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                        initializer_range=0.3)


def build(dense: Path, scheme: str, ignore=IGNORE, targets=("Linear",)) -> tuple[Path, Path]:
    base = dense.parent
    tag = scheme + ("" if ignore in (IGNORE, MIXTRAL_IGNORE) else "-router") + \
        ("" if targets == ("Linear",) else "-named")
    if not (base / tag).exists():
        write_quantized(dense, base / tag, scheme, base / f"{tag}-ref", ignore=ignore,
                        targets=targets)
    return base / tag, base / f"{tag}-ref"


def build_mixtral(dense: Path, scheme: str) -> tuple[Path, Path]:
    return build(dense, scheme, MIXTRAL_IGNORE, MIXTRAL_TARGETS)


def moe_layers(llm) -> list[FusedMoE]:
    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_BLOCK"])
def test_weight_only_experts_match_the_dequantised_model(dense_dir, scheme):
    quant, ref = build(dense_dir, scheme)
    llm = make_llm(quant)
    layers = moe_layers(llm)
    assert len(layers) == 2
    for moe in layers:
        assert isinstance(moe.w13, ExpertLinears) and isinstance(moe.w2, ExpertLinears)
        assert not isinstance(moe.gate, QuantLinear)  # the router stays dense
        for lin in [*moe.w13, *moe.w2]:  # kept quantised: under a 16-bit dense weight's bytes
            assert isinstance(lin, QuantLinear)
            held = sum(b.numel() * b.element_size() for b in lin.kernel.buffers())
            assert held < 2 * lin.in_features * lin.out_features
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


def per_token_fake_quant(scheme: str):
    """x -> x rounded per token through the scheme's activation grid, by compressed-tensors."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**SCHEMES[scheme][2])

    def fq(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scale, zero = calculate_qparams(flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True),
                                        args)
        return fake_quantize(flat, scale, zero, args).reshape(x.shape)

    return fq


def activation_quantised(model, scheme: str):
    """`model` (HF, dequantised weights) with the inputs of every quantised linear and of every
    expert projection fake-quantised per token; the router and lm_head left exact."""
    fq = per_token_fake_quant(scheme)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(("lm_head", "mlp.gate")):
            module.register_forward_pre_hook(lambda m, args: (fq(args[0]),))

    def experts_forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if len(tok):
                gate, up = F.linear(fq(hidden[tok]), self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(fq(self.act_fn(gate) * up), self.down_proj[e])
                out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out

    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(hasattr(m, "gate_up_proj") for m in experts)
    for m in experts:
        m.forward = types.MethodType(experts_forward, m)
    return model


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
def test_activation_quantised_experts_agree_teacher_forced(dense_dir, scheme):
    quant, ref = build(dense_dir, scheme)
    assert_agrees_teacher_forced(make_llm(quant), ref, scheme)


def assert_agrees_teacher_forced(llm, ref: Path, scheme: str) -> None:
    """The greedy tokens agree, teacher-forced, with the dequantised model whose linear and
    expert inputs are fake-quantised per token, within the logprob bound; and the same check
    fails once one expert's weight scale is 5% off (the negative control)."""
    assert all(isinstance(m.w13, ExpertLinears) for m in moe_layers(llm))
    hf_quant, hf_dense = activation_quantised(hf_model(ref), scheme), hf_model(ref)
    assert_near_fake_quantised(llm, hf_quant, hf_dense, scheme)
    assert_fault_is_caught(llm, hf_quant, hf_dense, scheme, expert=True)


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC"])
def test_each_experts_inputs_are_quantised_per_token(dense_dir, scheme):
    """One MoE layer alone on 40 random tokens: our quantised experts give the output of HF's
    sparse block with every expert input fake-quantised per token (tight), not the output of
    the same dequantised weights on exact activations (off by the rounding)."""
    quant, ref = build(dense_dir, scheme)
    assert_layer_matches_fake_quantised(moe_layers(make_llm(quant))[0], ref, scheme)


def assert_layer_matches_fake_quantised(moe: FusedMoE, ref: Path, scheme: str) -> None:
    """`moe` is HF's layer 1 sparse block of `ref`, its expert inputs fake-quantised."""
    block = activation_quantised(hf_model(ref), scheme).model.layers[1].mlp
    exact = hf_model(ref).model.layers[1].mlp
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, want, dense = moe(x[0]), block(x)[0], exact(x)[0]
    off = (ours - want).abs().max()
    assert off < 0.05 * (dense - want).abs().max(), (off, (dense - want).abs().max())


def test_two_ranks_cut_the_experts_rows_and_groups_with_their_scales(dense_dir):
    """Each rank keeps 32 of every expert's 64 intermediate rows of gate / up and the matching
    32-column group of down (asymmetric: zero points too); one all-reduce."""
    quant, ref = build(dense_dir, "W4A16_ASYM")
    llm = make_llm(quant, tensor_parallel_size=2)
    try:
        assert_matches_reference(llm, hf_model(ref), atol=2e-4)
    finally:
        llm.llm_engine.shutdown()


def test_a_quantised_router_is_refused_naming_the_fix(dense_dir, tmp_path):
    quant, _ = build(dense_dir, "W8A16", ignore=("lm_head",))
    # the checkpoint also quantises mlp.gate: our writer leaves it dense, so quantise it here
    from safetensors.torch import load_file, save_file

    state = load_file(quant / "model.safetensors")
    name = "model.layers.1.mlp.gate"
    w = state.pop(f"{name}.weight")
    scale = w.abs().amax(1, keepdim=True) / 127
    state[f"{name}.weight"] = torch.round(w / scale).to(torch.int8)
    state[f"{name}.weight_scale"] = scale
    save_file(state, quant / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match=r"mlp\.gate\.weight_scale.*router.*ignore"):
        make_llm(quant)


def test_other_quantised_moe_formats_are_refused_naming_the_supported(dense_dir, tmp_path):
    folder = tmp_path / "bnb"
    quant, _ = build(dense_dir, "W4A16")
    import shutil

    shutil.copytree(quant, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"'bitsandbytes'.*supported: compressed-tensors, gptq, "
                                          r"awq, fp8"):
        make_llm(folder)


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_BLOCK"])
def test_mixtral_experts_under_their_checkpoint_names_match_the_dequantised_model(mixtral_dir,
                                                                                scheme):
    """The config targets block_sparse_moe.experts.N.w1 / w3 / w2: each expert's gate / up are
    fused from w1 / w3, down is w2, every layer's experts kept quantised, the router dense."""
    quant, ref = build_mixtral(mixtral_dir, scheme)
    llm = make_llm(quant)
    layers = moe_layers(llm)
    assert len(layers) == 3
    for i, moe in enumerate(layers):
        assert isinstance(moe.w13, ExpertLinears) and not isinstance(moe.gate, QuantLinear)
        head = f"model.layers.{i}.block_sparse_moe.experts.3."
        assert moe.w13[3].hf_names == [head + "w1", head + "w3"]
        assert moe.w2[3].hf_names == [head + "w2"]
    assert_matches_reference(llm, hf_model(ref), atol=2e-4)


def test_mixtral_fp8_dynamic_experts_quantise_their_inputs_per_token(mixtral_dir):
    quant, ref = build_mixtral(mixtral_dir, "FP8_DYNAMIC")
    llm = make_llm(quant)
    assert_layer_matches_fake_quantised(moe_layers(llm)[1], ref, "FP8_DYNAMIC")
    assert_agrees_teacher_forced(llm, ref, "FP8_DYNAMIC")


@pytest.fixture(scope="module")
def fused_kernel():
    with triton_interpreted("kvserve.kernels.triton_moe"):
        yield


def assert_experts_stacked(llm) -> list[FusedMoE]:
    """Every MoE layer's experts stacked for the fused kernel, no per-expert kernel beside them,
    in fewer bytes than the dense weights would take at 16 bits."""
    layers = moe_layers(llm)
    assert layers
    for layer in layers:
        assert all(lin.kernel is None for lin in [*layer.w13, *layer.w2])
        for stacked in (layer.w13_stacked, layer.w2_stacked):
            held = sum(b.numel() * b.element_size() for b in stacked.buffers())
            assert held < 2 * stacked.codes.shape[0] * stacked.n * stacked.k
    return layers


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_BLOCK", "W8A8",
                                    "FP8_DYNAMIC"])
def test_experts_stacked_for_the_fused_gpu_kernel(dense_dir, fused_kernel, monkeypatch, scheme):
    """The GPU's form of quantised experts (stacked at load, through the fused Triton kernel;
    forced here on the CPU, interpreted): weight-only schemes give the dequantised model's
    greedy tokens and logprobs, activation-quantised ones HF's sparse block with per-token
    fake-quantised expert inputs."""
    monkeypatch.setattr(moe_module, "stack_on", lambda device: True)
    quant, ref = build(dense_dir, scheme)
    llm = make_llm(quant)
    layers = assert_experts_stacked(llm)
    if scheme in ("W8A8", "FP8_DYNAMIC"):
        assert_layer_matches_fake_quantised(layers[0], ref, scheme)
    else:
        assert_matches_reference(llm, hf_model(ref), atol=2e-4)

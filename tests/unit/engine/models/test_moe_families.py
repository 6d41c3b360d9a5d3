"""Mixtral, Qwen2-MoE (shared expert, dense layers among sparse ones) and Qwen3-MoE (q/k
norms, decoder_sparse_step) against HF transformers through the whole engine: greedy tokens and
per-token logprobs, prefix cache cold and warm, n = 2, and tensor parallelism over 2 ranks."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import make_llm
from forked_workers import forked_workers
from family_checks import build_family, check_family, copy_with
from kvserve.engine.errors import ConfigError, ModelNotFoundError
from kvserve.engine.layers.moe import FusedMoE
from kvserve.engine.worker.model_loader import iter_weights, load_model
from kvserve.engine.layers.mlp import GatedMLP

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Workers fork from a preloaded fork server (forked_workers.py): no import each."""
    with forked_workers():
        yield


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("mixtral"), "MixtralForCausalLM",
                        num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    # Layer 0 dense (mlp_only_layers), layers 1-2 sparse with the gated shared expert;
    # norm_topk_prob off (Qwen1.5-MoE's setting).
    return build_family(tmp_path_factory.mktemp("qwen2moe"), "Qwen2MoeForCausalLM",
                        num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                        norm_topk_prob=False, **MOE)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    # decoder_sparse_step 2: layer 1 sparse, layers 0 and 2 dense; 3 experts of 4 per token.
    return build_family(tmp_path_factory.mktemp("qwen3moe"), "Qwen3MoeForCausalLM",
                        num_experts=4, decoder_sparse_step=2, norm_topk_prob=True,
                        **{**MOE, "num_experts_per_tok": 3})


def layer_kinds(folder) -> list[str]:
    model, _ = load_model(folder, torch.float32, torch.device("cpu"), pack_linears=False)
    return [type(layer.mlp).__name__ for layer in model.model.layers]


def test_mixtral_matches_hf(mixtral_dir):
    assert layer_kinds(mixtral_dir) == ["FusedMoE"] * 3
    check_family(mixtral_dir)


def test_qwen2_moe_matches_hf(qwen2_moe_dir):
    assert layer_kinds(qwen2_moe_dir) == ["GatedMLP", "FusedMoE", "FusedMoE"]
    check_family(qwen2_moe_dir)


def test_qwen3_moe_matches_hf(qwen3_moe_dir):
    assert layer_kinds(qwen3_moe_dir) == ["GatedMLP", "FusedMoE", "GatedMLP"]
    check_family(qwen3_moe_dir)


@pytest.mark.parametrize("family", ["qwen2_moe_dir", "mixtral_dir", "qwen3_moe_dir"])
def test_two_ranks_match_hf(request, family):
    """Each rank holds half of every expert (and of the shared expert); one all-reduce."""
    check_family(request.getfixturevalue(family), tensor_parallel_size=2)


def test_experts_are_stored_stacked_from_the_per_expert_tensors(qwen2_moe_dir):
    model, _ = load_model(qwen2_moe_dir, torch.float32, torch.device("cpu"), pack_linears=False)
    weights = dict(iter_weights(qwen2_moe_dir))
    moe = model.model.layers[2].mlp
    assert isinstance(moe, FusedMoE) and isinstance(model.model.layers[0].mlp, GatedMLP)
    head = "model.layers.2.mlp."
    assert torch.equal(moe.w13[3, :32], weights[head + "experts.3.gate_proj.weight"])
    assert torch.equal(moe.w13[3, 32:], weights[head + "experts.3.up_proj.weight"])
    assert torch.equal(moe.w2[1], weights[head + "experts.1.down_proj.weight"])
    assert torch.equal(moe.shared_expert.down_proj.weight,
                       weights[head + "shared_expert.down_proj.weight"])


def test_unknown_config_field_is_refused_by_name(tmp_path, mixtral_dir):
    folder = copy_with(mixtral_dir, tmp_path / "odd", moe_layer_freq=2)
    with pytest.raises(ConfigError, match="moe_layer_freq"):
        make_llm(folder)


def test_a_missing_expert_tensor_is_named(tmp_path, mixtral_dir):
    from safetensors.torch import save_file

    folder = tmp_path / "partial"
    shutil.copytree(mixtral_dir, folder)
    weights = dict(iter_weights(folder))
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelNotFoundError, match=r"lacks 1 expert tensor.*layers\.1\..*2\.up"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_tensor_parallel_size_must_divide_the_expert_width(tmp_path):
    folder = build_family(tmp_path / "odd", "Qwen3MoeForCausalLM", num_experts=4,
                          moe_intermediate_size=30, num_experts_per_tok=2)
    from kvserve.engine.distributed import TPGroup

    with pytest.raises(ConfigError, match="expert intermediate size 30"):
        load_model(folder, torch.float32, torch.device("cpu"), tp=TPGroup(0, 4))
    with pytest.raises(ConfigError, match="moe_intermediate_size=30"):  # before any worker
        make_llm(folder, tensor_parallel_size=4)


@pytest.mark.parametrize("arch,kw", [
    ("MixtralForCausalLM", dict(num_local_experts=4, sliding_window=11)),  # every layer slides
    ("Qwen2MoeForCausalLM", dict(num_experts=4, shared_expert_intermediate_size=48,
                                 moe_intermediate_size=32, use_sliding_window=True,
                                 sliding_window=11, max_window_layers=3)),  # layers 0 and 2
], ids=["mixtral", "qwen2_moe"])
def test_sliding_windows_match_hf(tmp_path, arch, kw):
    folder = build_family(tmp_path / arch, arch, num_experts_per_tok=2, **kw)
    model, config = load_model(folder, torch.float32, torch.device("cpu"), pack_linears=False)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == ([11, 11, 11] if arch.startswith("Mixtral") else [11, None, 11])
    check_family(folder)  # prompts of 19 and 37 tokens: well past the window


@pytest.mark.parametrize("family", ["qwen2_moe_dir", "mixtral_dir"])
def test_bf16_error_is_no_worse_than_hf_bf16(request, family):
    """Against fp32 HF, our bf16 MoE errs about as much as HF's own bf16 model does (both may
    route a near-tied token differently from fp32)."""
    from test_llama import PagedSequences, hf_logits
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(family)
    ours, config = load_model(folder, torch.bfloat16, torch.device("cpu"))
    assert ours.model.layers[1].mlp.w13.dtype == torch.bfloat16
    tokens = torch.randint(3, config.vocab_size, (30,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    paged = PagedSequences(config)
    paged.caches = [(k.bfloat16(), v.bfloat16()) for k, v in paged.caches]
    logits = paged.step(ours, {0: tokens})[0].float()
    ref, hf_bf16 = (hf_logits(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval(),
                              tokens) for dtype in (torch.float32, torch.bfloat16))
    ours_err, hf_err = (logits - ref).abs().mean(), (hf_bf16 - ref).abs().mean()
    assert 0 < ours_err <= 1.5 * hf_err, (ours_err, hf_err)

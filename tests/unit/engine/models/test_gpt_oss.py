"""gpt-oss (bf16 layout) against HF transformers through the whole engine: attention sinks,
sliding layers alternating with full ones (prompts well past the window), YaRN RoPE, biased
router and experts, the clamped SwiGLU; greedy tokens and per-token logprobs with the prefix
cache cold and warm, n = 2, and tensor parallelism over 2 ranks."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llm
from family_checks import build_family, check_family, copy_with
from kvserve.engine.errors import ConfigError
from kvserve.engine.worker.model_loader import iter_weights, load_model

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    # 3 layers: sliding (window 11), full, sliding; 4 experts, 2 per token; a low SwiGLU limit
    # so that the clamp bites on random weights.
    folder = build_family(tmp_path_factory.mktemp("gptoss"), "GptOssForCausalLM",
                          num_local_experts=4, num_experts_per_tok=2, sliding_window=11,
                          rope_parameters=YARN, swiglu_limit=1.5)
    return folder


def test_layers_hold_sinks_windows_and_stacked_experts(gpt_oss_dir):
    model, config = load_model(gpt_oss_dir, torch.float32, torch.device("cpu"),
                               pack_linears=False)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [11, None, 11]
    weights = dict(iter_weights(gpt_oss_dir))
    assert torch.equal(attns[1].sinks, weights["model.layers.1.self_attn.sinks"])
    moe = model.model.layers[2].mlp
    gate_up = weights["model.layers.2.mlp.experts.gate_up_proj"]  # [E, H, 2I], interleaved
    assert torch.equal(moe.w13[1, :96], gate_up[1, :, 0::2].T)  # gate columns first
    assert torch.equal(moe.w13[1, 96:], gate_up[1, :, 1::2].T)
    assert torch.equal(moe.gate.bias, weights["model.layers.2.mlp.router.bias"])


def test_gpt_oss_matches_hf(gpt_oss_dir):
    check_family(gpt_oss_dir)


def test_two_ranks_match_hf(gpt_oss_dir):
    """Each rank: 2 of the 4 heads with their sinks, half of every expert, the down bias once."""
    check_family(gpt_oss_dir, tensor_parallel_size=2)


@pytest.mark.parametrize("change,match", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4'"),
    ({"swiglu_beta": 1.0}, "swiglu_beta"),
    ({"rope_parameters": {**YARN, "rope_type": "su"}}, "rope_type"),
])
def test_what_we_do_not_implement_is_refused_by_name(tmp_path, gpt_oss_dir, change, match):
    folder = copy_with(gpt_oss_dir, tmp_path / "odd", **change)
    with pytest.raises(ConfigError, match=match):
        make_llm(folder)

"""The config.json files the MoE models are published with (as on the hub, every field kept)
are read into the right layer choices, not refused: a real checkpoint must load. OpenAI's own
gpt-oss config (MXFP4 experts) is refused by name; its bf16 re-saves are accepted."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.errors import ConfigError
from kvserve.engine.layers.rotary import check_rope, rope_parameters
from kvserve.engine.models import model_class_for
from kvserve.engine.worker.model_loader import load_config

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
    "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088}
MXFP4 = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def spec_of(tmp_path, cfg: dict):
    """The family's layer choices; the rope parameters pass the rotary module's checks too."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = load_config(tmp_path)
    spec = model_class_for(config).spec_from_config(config, None)
    check_rope(rope_parameters(config))
    return spec


def test_mixtral_8x7b(tmp_path):
    spec = spec_of(tmp_path, MIXTRAL_8X7B)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate) == (8, 2, 14336)
    assert spec.moe.renormalize and spec.sparse == (True,) * 32 and spec.windows == ()


def test_qwen15_moe_with_its_shared_expert(tmp_path):
    spec = spec_of(tmp_path, QWEN15_MOE)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.shared_intermediate) == (60, 4, 5632)
    assert not spec.moe.renormalize and spec.dims.qkv_bias and not spec.dims.o_bias
    assert spec.windows == ()  # sliding_window is set, use_sliding_window is not


def test_qwen3_30b_a3b(tmp_path):
    spec = spec_of(tmp_path, QWEN3_30B_A3B)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate) == (128, 8, 768)
    assert spec.moe.renormalize and spec.qk_norm and spec.sparse == (True,) * 48


def test_gpt_oss_20b_in_bf16_and_its_mxfp4_original(tmp_path):
    spec = spec_of(tmp_path, GPT_OSS_20B)
    assert spec.attn_sinks and spec.windows[:3] == (128, None, 128)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.activation) == (32, 4,
                                                                          "swiglu_clamped")
    assert spec.moe.router_bias and spec.moe.expert_bias and spec.moe.swiglu_limit == 7.0
    with pytest.raises(ConfigError, match="quant_method 'mxfp4'.*bf16"):
        spec_of(tmp_path, {**GPT_OSS_20B, "quantization_config": MXFP4})

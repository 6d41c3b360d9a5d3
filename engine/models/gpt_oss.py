"""gpt-oss (bf16 checkpoint layout): q/k/v/o with biases and a learned attention sink per head,
sliding and full layers alternating per layer_types, YaRN RoPE, and every MLP an MoE whose
router and experts carry biases, top-k over the router logits then a softmax over the chosen,
and the clamped SwiGLU (alpha, limit) on interleaved gate/up columns (de-interleaved at load)."""

from __future__ import annotations

from kvserve.engine.layers.moe import MoESpec
from kvserve.engine.models.config_keys import check_config_keys
from kvserve.engine.models.decoder import DecoderSpec, decoder_dims
from kvserve.engine.models.moe_decoder import (MoEDecoderForCausalLM, refuse_quantized,
                                               sparse_layers)
from kvserve.engine.models.windows import layer_windows

# hidden_act is not read by gpt-oss's experts (their activation is the clamped SwiGLU);
# experts_per_token / initial_context_length repeat num_experts_per_tok and YaRN's original
# length in OpenAI's own config; router fields: training only.
GPT_OSS_KEYS = frozenset({
    "attention_bias", "hidden_act", "layer_types", "sliding_window", "num_local_experts",
    "num_experts_per_tok", "experts_per_token", "initial_context_length", "swiglu_alpha",
    "swiglu_limit", "output_router_logits", "router_aux_loss_coef"})


class GptOssForCausalLM(MoEDecoderForCausalLM):
    stacked_experts = True

    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_config_keys(config, "GptOssForCausalLM", GPT_OSS_KEYS)
        refuse_quantized(config, "GptOssForCausalLM")
        moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                      hidden=config.hidden_size, intermediate=config.intermediate_size,
                      renormalize=True, router_bias=True, expert_bias=True,
                      activation="swiglu_clamped", swiglu_alpha=float(config.swiglu_alpha),
                      swiglu_limit=float(config.swiglu_limit))
        return DecoderSpec(decoder_dims(config), windows=layer_windows(config), moe=moe,
                           sparse=sparse_layers(config, moe.num_experts), attn_sinks=True,
                           max_model_len=max_model_len)

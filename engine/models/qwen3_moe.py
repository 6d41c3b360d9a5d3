"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the Qwen3 stack (per-head q/k RMSNorm) whose sparse
layers route to num_experts experts, no shared expert, weights renormalised per norm_topk_prob;
which layers are sparse comes from decoder_sparse_step and mlp_only_layers."""

from __future__ import annotations

from kvserve.engine.layers.moe import MoESpec
from kvserve.engine.models.decoder import DecoderSpec, decoder_dims
from kvserve.engine.models.moe_decoder import (MoEDecoderForCausalLM, check_swiglu_moe_config,
                                               sparse_layers)
from kvserve.engine.models.windows import layer_windows

# HF's config drops sliding_window unless use_sliding_window, and then every layer slides
# (max_window_layers is not read by HF's Qwen3-MoE); router fields: training only.
QWEN3_MOE_KEYS = frozenset({
    "hidden_act", "attention_bias", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "sliding_window", "use_sliding_window", "max_window_layers", "output_router_logits",
    "router_aux_loss_coef"})


class Qwen3MoeForCausalLM(MoEDecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_swiglu_moe_config(config, "Qwen3MoeForCausalLM", QWEN3_MOE_KEYS)
        moe = MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                      hidden=config.hidden_size, intermediate=config.moe_intermediate_size,
                      renormalize=bool(config.norm_topk_prob))
        return DecoderSpec(decoder_dims(config), qk_norm=True, max_model_len=max_model_len,
                           windows=layer_windows(config, all_layers_slide=True), moe=moe,
                           sparse=sparse_layers(config, moe.num_experts))

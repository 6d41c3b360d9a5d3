"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 stack (q/k/v biases) whose sparse layers
route to num_experts experts plus one shared expert scaled by a sigmoid gate; which layers are
sparse comes from decoder_sparse_step and mlp_only_layers, sliding ones from layer_types."""

from __future__ import annotations

from dataclasses import replace

from kvserve.engine.layers.moe import MoESpec
from kvserve.engine.models.decoder import DecoderSpec, decoder_dims
from kvserve.engine.models.moe_decoder import (MoEDecoderForCausalLM, check_swiglu_moe_config,
                                               sparse_layers)
from kvserve.engine.models.windows import layer_windows

# use_sliding_window / max_window_layers are read through layer_types, which HF derives from
# them; output_router_logits and router_aux_loss_coef are training only.
QWEN2_MOE_KEYS = frozenset({
    "hidden_act", "qkv_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "layer_types", "sliding_window", "use_sliding_window",
    "max_window_layers", "output_router_logits", "router_aux_loss_coef"})


class Qwen2MoeForCausalLM(MoEDecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_swiglu_moe_config(config, "Qwen2MoeForCausalLM", QWEN2_MOE_KEYS)
        dims = replace(decoder_dims(config), qkv_bias=bool(getattr(config, "qkv_bias", True)),
                       o_bias=False)
        moe = MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                      hidden=config.hidden_size, intermediate=config.moe_intermediate_size,
                      renormalize=bool(config.norm_topk_prob),
                      shared_intermediate=config.shared_expert_intermediate_size)
        return DecoderSpec(dims, windows=layer_windows(config), max_model_len=max_model_len,
                           moe=moe, sparse=sparse_layers(config, moe.num_experts))

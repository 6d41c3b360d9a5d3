"""Mixtral: the Mistral stack with every MLP a sparse mixture of num_local_experts SwiGLU
experts (the top num_experts_per_tok per token, their weights renormalised to sum to 1); a
sliding window, when set, on every layer."""

from __future__ import annotations

from kvserve.engine.layers.moe import MoESpec
from kvserve.engine.models.decoder import DecoderSpec, decoder_dims
from kvserve.engine.models.moe_decoder import (MoEDecoderForCausalLM, check_swiglu_moe_config,
                                               sparse_layers)
from kvserve.engine.models.windows import layer_windows

# output_router_logits, router_aux_loss_coef, router_jitter_noise: training only.
MIXTRAL_KEYS = frozenset({"hidden_act", "num_local_experts", "num_experts_per_tok",
                          "sliding_window", "output_router_logits", "router_aux_loss_coef",
                          "router_jitter_noise"})


class MixtralForCausalLM(MoEDecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_swiglu_moe_config(config, "MixtralForCausalLM", MIXTRAL_KEYS)
        moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                      hidden=config.hidden_size, intermediate=config.intermediate_size,
                      renormalize=True)
        return DecoderSpec(decoder_dims(config), max_model_len=max_model_len, moe=moe,
                           windows=layer_windows(config, all_layers_slide=True),
                           sparse=sparse_layers(config, moe.num_experts))

"""Mixtral: the Mistral stack with every MLP a sparse mixture of num_local_experts SwiGLU
experts (the top num_experts_per_tok per token, their weights renormalised to sum to 1); a
sliding window, when set, on every layer."""

from __future__ import annotations

import re

from kvserve.engine.layers.moe import MoESpec
from kvserve.engine.models.decoder import DecoderSpec, decoder_dims
from kvserve.engine.models.moe_decoder import (MoEDecoderForCausalLM, check_swiglu_moe_config,
                                               sparse_layers)
from kvserve.engine.models.windows import layer_windows

# output_router_logits, router_aux_loss_coef, router_jitter_noise: training only.
MIXTRAL_KEYS = frozenset({"hidden_act", "num_local_experts", "num_experts_per_tok",
                          "sliding_window", "output_router_logits", "router_aux_loss_coef",
                          "router_jitter_noise"})
# Our module name -> the checkpoint's: the MoE block is block_sparse_moe, the experts' gate / up /
# down projections are w1 / w3 / w2 (what quantization_config targets and ignore lists name).
_OURS = re.compile(r"(.*\.)mlp\.(gate|experts\.\d+\.(gate_proj|up_proj|down_proj))")
_EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class MixtralForCausalLM(MoEDecoderForCausalLM):
    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """`name` as Mixtral checkpoints spell it (model.layers.0.mlp.experts.3.gate_proj ->
        model.layers.0.block_sparse_moe.experts.3.w1); other modules keep their name."""
        m = _OURS.fullmatch(name)
        if m is None:
            return name
        tail = m[2] if m[3] is None else m[2][: -len(m[3])] + _EXPERT_PROJ[m[3]]
        return f"{m[1]}block_sparse_moe.{tail}"

    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_swiglu_moe_config(config, "MixtralForCausalLM", MIXTRAL_KEYS)
        moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                      hidden=config.hidden_size, intermediate=config.intermediate_size,
                      renormalize=True)
        return DecoderSpec(decoder_dims(config), max_model_len=max_model_len, moe=moe,
                           windows=layer_windows(config, all_layers_slide=True),
                           sparse=sparse_layers(config, moe.num_experts))

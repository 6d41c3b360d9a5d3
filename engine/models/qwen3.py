"""Qwen3: the Llama stack with an RMSNorm per head on q and k before RoPE, an explicit head_dim
and no qkv bias; sliding layers, if any, come from config.layer_types."""

from __future__ import annotations

from kvserve.engine.models.config_keys import check_config_keys, require_value
from kvserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, decoder_dims
from kvserve.engine.models.windows import layer_windows

# use_sliding_window / max_window_layers are read through layer_types, which HF derives from them.
QWEN3_KEYS = frozenset({"attention_bias", "hidden_act", "layer_types", "sliding_window",
                        "use_sliding_window", "max_window_layers"})


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_config_keys(config, "Qwen3ForCausalLM", QWEN3_KEYS)
        require_value(config, "hidden_act", ("silu",), "Qwen3ForCausalLM")
        return DecoderSpec(decoder_dims(config), qk_norm=True,
                           windows=layer_windows(config), max_model_len=max_model_len)

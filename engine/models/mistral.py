"""Mistral: Llama with config.sliding_window on every layer (when set)."""

from __future__ import annotations

from kvserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, decoder_dims
from kvserve.engine.models.llama import require_silu
from kvserve.engine.models.windows import layer_windows


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        require_silu(config)
        return DecoderSpec(decoder_dims(config),
                           windows=layer_windows(config, all_layers_slide=True),
                           max_model_len=max_model_len)

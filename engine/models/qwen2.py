"""Qwen2: Llama with biases on q/k/v (always) but none on o; sliding layers, if any, come from
config.layer_types (HF derives them from use_sliding_window / max_window_layers)."""

from __future__ import annotations

from dataclasses import replace

from kvserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, decoder_dims
from kvserve.engine.models.llama import require_silu
from kvserve.engine.models.windows import layer_windows


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        require_silu(config)
        dims = replace(decoder_dims(config), qkv_bias=True, o_bias=False)
        return DecoderSpec(dims, windows=layer_windows(config), max_model_len=max_model_len)

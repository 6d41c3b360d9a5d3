"""Llama: the decoder stack as decoder.py draws it, with a SiLU gated MLP and q/k/v/o biases when
config.attention_bias is set; sliding layers, if any, come from config.layer_types."""

from __future__ import annotations

from kvserve.engine.errors import ConfigError
from kvserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, decoder_dims
from kvserve.engine.models.windows import layer_windows


def require_silu(config) -> None:
    """The Llama-family MLP is SiLU-gated; other activations change the model."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (Llama-family uses 'silu')")


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        require_silu(config)
        return DecoderSpec(decoder_dims(config), windows=layer_windows(config),
                           max_model_len=max_model_len)

"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm as x * (1 + w) before
and after both attention and the MLP, GeGLU (tanh GELU), attention scale query_pre_attn_scalar
** -0.5, optional attention-logit and final-logit soft caps; Gemma 3 adds q/k norms and its own
RoPE table for sliding layers (rope_parameters per layer type). Sliding or full attention per
layer comes from config.layer_types."""

from __future__ import annotations

from kvserve.engine.errors import ConfigError
from kvserve.engine.models.config_keys import check_config_keys, require_value
from kvserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, decoder_dims
from kvserve.engine.models.windows import layer_windows

GEMMA_KEYS = frozenset({"attention_bias", "hidden_activation", "hidden_act", "layer_types",
                        "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                        "final_logit_softcapping", "use_bidirectional_attention",
                        # legacy spellings HF folds into layer_types / rope_parameters
                        "sliding_window_pattern", "_sliding_window_pattern",
                        "rope_local_base_freq"})


def gemma_spec(config, family: str, max_model_len: int | None, qk_norm: bool) -> DecoderSpec:
    check_config_keys(config, family, GEMMA_KEYS)
    require_value(config, "use_bidirectional_attention", (None, False), family)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{family}: hidden_activation {act!r} is not supported (kvserve "
                          "implements 'gelu_pytorch_tanh')")
    windows = layer_windows(config)
    per_type = set(getattr(config, "rope_parameters", None) or {}) <= {"full_attention",
                                                                       "sliding_attention"}
    rope_types = ()
    if per_type and getattr(config, "rope_parameters", None):
        types = list(getattr(config, "layer_types", None) or [])
        rope_types = tuple(types) or ("full_attention",) * config.num_hidden_layers
    dims = decoder_dims(config)
    return DecoderSpec(
        dims, gemma_norms=True, qk_norm=qk_norm, activation="gelu_tanh",
        embed_scale=config.hidden_size ** 0.5,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_soft_cap=getattr(config, "attn_logit_softcapping", None) or None,
        final_soft_cap=getattr(config, "final_logit_softcapping", None) or None,
        windows=windows, rope_types=rope_types, max_model_len=max_model_len)


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        return gemma_spec(config, "Gemma2ForCausalLM", max_model_len, qk_norm=False)


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        return gemma_spec(config, "Gemma3ForCausalLM", max_model_len, qk_norm=True)

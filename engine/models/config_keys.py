"""Refuse a config field we do not implement: each family names the config.json keys it reads and
those that are safe to ignore at inference; anything else is a ConfigError naming the key."""

from __future__ import annotations

from kvserve.engine.errors import ConfigError

# Present in every transformers config, or harmless at inference for any family: bookkeeping,
# token ids (the tokenizer/generation side reads them), training-only fields (dropout, init),
# the KV-cache hint HF's generate reads, and quantization_config (engine/layers/quantization).
COMMON_KEYS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "label2id", "is_encoder_decoder", "model_type", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "attention_dropout", "cache_implementation", "quantization_config",
    # read by every family of this engine
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings",
})


def check_config_keys(config, family: str, understood: frozenset[str]) -> None:
    """Raise ConfigError if `config` carries a key neither common nor in `understood`."""
    unknown = sorted(set(config.to_dict()) - COMMON_KEYS - understood)
    if unknown:
        raise ConfigError(
            f"{family}: config field(s) {unknown} are not implemented by kvserve; running without "
            "them would give a different model than its authors'. Remove them from config.json "
            "only if you know they do not change the forward pass.")


def require_value(config, key: str, allowed: tuple, family: str) -> None:
    """A key whose other values change the model: refuse them by name."""
    value = getattr(config, key, None)
    if value not in allowed:
        raise ConfigError(f"{family}: {key}={value!r} is not supported (kvserve implements "
                          f"{', '.join(repr(a) for a in allowed)})")

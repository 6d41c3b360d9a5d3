"""Phi-3 against HF transformers through the whole engine: fused qkv_proj / gate_up_proj in the
checkpoint, a sliding window on every layer, and LongRoPE with partial rotary dims, its factor
set chosen once from max_model_len."""

from __future__ import annotations

import pytest

from family_checks import build_family, check_family

HALF_ROTARY = 4  # head_dim 16 x partial_rotary_factor 0.5 / 2


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("phi3"), "Phi3ForCausalLM", sliding_window=11)


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    return build_family(
        tmp_path_factory.mktemp("phi3-longrope"), "Phi3ForCausalLM",
        max_position_embeddings=256, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 100.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0 + 0.3 * i for i in range(HALF_ROTARY)],
                         "long_factor": [3.0 + 2.0 * i for i in range(HALF_ROTARY)]})


def test_phi3_matches_hf(phi3_dir):
    check_family(phi3_dir)


def test_phi3_longrope_long_factors_match_hf(longrope_dir):
    """max_model_len 256 > 16: long factors everywhere, as HF for sequences past 16 tokens."""
    check_family(longrope_dir, lens=(17, 23, 37))


def test_phi3_longrope_short_factors_match_hf(longrope_dir):
    """max_model_len 16 (= the original context): the short factors, as HF for short sequences;
    TP = 2 ranks agree (each worker builds its table from the same max_model_len)."""
    check_family(longrope_dir, lens=(9, 12, 5), max_tokens=4, max_model_len=16)
    check_family(longrope_dir, lens=(9, 12, 5), max_tokens=4, max_model_len=16,
                 tensor_parallel_size=2)


@pytest.mark.parametrize("key,value,ok", [("full_attn_mod", 1, True), ("full_attn_mod", 2, False),
                                          ("attention_bias", True, False),
                                          ("dense_attention_every_n_layers", 2, False)])
def test_phi3_config_fields_are_read_or_refused_by_name(key, value, ok):
    """Phi-4-mini's extra fields pass at their neutral values; anything else names the key."""
    import transformers

    from kvserve.engine.errors import ConfigError
    from kvserve.engine.models.phi3 import Phi3ForCausalLM

    config = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, vocab_size=64, **{key: value})
    if ok:
        assert Phi3ForCausalLM.spec_from_config(config, None).dims.hidden == 32
    else:
        with pytest.raises(ConfigError, match=key):
            Phi3ForCausalLM.spec_from_config(config, None)

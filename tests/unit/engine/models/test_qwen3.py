"""Qwen3 (q/k norms, explicit head_dim, a sliding layer from use_sliding_window /
max_window_layers) against HF transformers through the whole engine."""

from __future__ import annotations

import pytest

from family_checks import build_family, check_family, copy_with
from kvserve.engine.errors import ConfigError


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    # Layer 0 full attention, layers 1-2 slide over 11 tokens; head_dim 16 != 64 / 4 heads.
    return build_family(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM", hidden_size=48,
                        use_sliding_window=True, sliding_window=11, max_window_layers=1)


def test_qwen3_matches_hf(qwen3_dir):
    check_family(qwen3_dir)


def test_qwen3_with_attention_bias_matches_hf(tmp_path):
    check_family(build_family(tmp_path, "Qwen3ForCausalLM", attention_bias=True))


def test_unknown_config_field_is_refused_by_name(tmp_path, qwen3_dir):
    from conftest import make_llm

    folder = copy_with(qwen3_dir, tmp_path / "odd", attn_temperature_tuning=True)
    with pytest.raises(ConfigError, match="attn_temperature_tuning"):
        make_llm(folder)

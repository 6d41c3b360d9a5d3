"""Gemma 2 and Gemma 3 (text) against HF transformers through the whole engine: scaled
embeddings, 1 + w norms around attention and MLP, GeGLU, query_pre_attn_scalar, sliding and
full layers from layer_types, soft caps (Gemma 2), q/k norms and per-layer-type RoPE (Gemma 3)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llm
from family_checks import (assert_matches_hf, build_family, check_family, copy_with, hf_model,
                           prompts, run)
from kvserve.engine.errors import ConfigError

LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    # Caps small enough to bind on these random weights (logits reach ~10, scores ~5).
    return build_family(tmp_path_factory.mktemp("gemma2"), "Gemma2ForCausalLM",
                        layer_types=LAYERS, sliding_window=11, query_pre_attn_scalar=24,
                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_family(
        tmp_path_factory.mktemp("gemma3"), "Gemma3ForCausalLM", layer_types=LAYERS,
        sliding_window=11, query_pre_attn_scalar=24,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}})


def test_gemma2_matches_hf(gemma2_dir):
    check_family(gemma2_dir)


def test_gemma3_matches_hf(gemma3_dir):
    check_family(gemma3_dir)


def test_gemma2_soft_caps_show_in_the_logprobs(gemma2_dir, tmp_path):
    """The same weights without the caps give other logprobs (so the match above needs them),
    while the final cap alone leaves the greedy tokens as they are."""
    uncapped = copy_with(gemma2_dir, tmp_path / "uncapped", final_logit_softcapping=None)
    capped_hf, uncapped_hf = hf_model(gemma2_dir), hf_model(uncapped)
    token_prompts = prompts(capped_hf.config.vocab_size)
    llm = make_llm(uncapped, block_size=8)
    out = run(llm, token_prompts)
    assert_matches_hf(uncapped_hf, token_prompts, out)
    capped = run(make_llm(gemma2_dir, block_size=8), token_prompts)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in capped]
    gap = max(abs(a[t].logprob - b[t].logprob) for o, c in zip(out, capped)
              for t, a, b in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                 c.outputs[0].logprobs))
    assert gap > 0.05


def test_bidirectional_gemma3_is_refused(gemma3_dir, tmp_path):
    folder = copy_with(gemma3_dir, tmp_path / "bidi", use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="use_bidirectional_attention=True"):
        make_llm(folder)


def test_embedding_scale_is_rounded_to_the_model_dtype(gemma3_dir):
    from kvserve.engine.models.gemma import Gemma3ForCausalLM
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gemma3_dir)
    model = Gemma3ForCausalLM(config, torch.bfloat16)
    assert model.model.embed_scale == torch.tensor(8.0, dtype=torch.bfloat16).item() == 8.0
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [11, None, 11]

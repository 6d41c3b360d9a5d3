"""Tensor parallelism (2 ranks over gloo) for every new family: each rank holds half the heads
(one KV head), half the MLP and of the vocabulary; greedy tokens and logprobs still match HF."""

from __future__ import annotations

import pytest

from conftest import make_llm
from forked_workers import forked_workers
from family_checks import assert_matches_hf, build_family, hf_model, prompts, run

FAMILIES = {
    "Qwen3ForCausalLM": dict(use_sliding_window=True, sliding_window=11, max_window_layers=1),
    "Gemma2ForCausalLM": dict(layer_types=["sliding_attention", "full_attention"] * 1 +
                              ["sliding_attention"], sliding_window=11,
                              query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0),
    "Gemma3ForCausalLM": dict(layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"], sliding_window=11,
                              query_pre_attn_scalar=24),
    "Phi3ForCausalLM": dict(sliding_window=11),
}


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Workers fork from a preloaded fork server (forked_workers.py): no import each."""
    with forked_workers():
        yield


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_two_ranks_match_hf(tmp_path, arch):
    folder = build_family(tmp_path, arch, **FAMILIES[arch])
    hf = hf_model(folder)
    token_prompts = prompts(hf.config.vocab_size)
    llm = make_llm(folder, tensor_parallel_size=2, block_size=8, max_num_batched_tokens=16)
    try:
        cold = run(llm, token_prompts)
        assert_matches_hf(hf, token_prompts, cold)
        warm = run(llm, token_prompts)
        assert sum(o.num_cached_tokens for o in warm) > 0
        assert_matches_hf(hf, token_prompts, warm)
    finally:
        llm.shutdown()

"""A beam group's blocks (engine/core/beam_group.py): the beams hold their prompt's blocks once
(reference counts), a pruned or finished beam releases its blocks at once, and a group the pool
cannot hold is preempted whole and still finds the same beams."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm
from family_checks import build_family, prompts
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sample.beam_search import BeamSearchParams, beam_params


def _held(engine) -> int:
    pool = engine.kv.pool
    return pool.num_blocks - pool.num_free_blocks


def test_width_8_holds_a_1k_token_prompt_once(tmp_path):
    path = build_family(tmp_path / "m", "Qwen3ForCausalLM", max_position_embeddings=2048)
    llm = make_llm(path, block_size=16, max_model_len=1100, enable_prefix_caching=False)
    engine = llm.llm_engine
    try:
        prompt = prompts(engine.vocab_size, (1024,))[0]  # 64 full blocks
        engine.add_request("beams", prompt, beam_params(8, 6, ignore_eos=True))
        seen = 0
        while engine.has_unfinished_requests():
            engine.step()
            state = engine.requests.get("beams")
            if state is None or len(state.seqs) < 8:
                continue
            tables = [engine.kv.block_ids(s) for s in state.seqs]
            assert all(t[:64] == tables[0][:64] for t in tables)  # one copy of the prompt
            # the prompt once, plus at most one private (copy-on-write) block per beam:
            # without sharing it would be 8 x 65 blocks, more than this pool holds
            assert _held(engine) <= 64 + 8 < 8 * 65
            assert len({b for t in tables for b in t}) == _held(engine)  # nothing else held
            seen += 1
        assert seen >= 4
        assert _held(engine) == 0  # finished and pruned beams gave every block back
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocks", [22, 16])
def test_a_preempted_group_finds_the_same_beams(tmp_path, blocks):
    """Four beam searches in a pool that holds about two: groups are preempted whole (by
    recompute) and readmitted; every one ends with the beams it finds alone."""
    path = build_family(tmp_path / "m", "LlamaForCausalLM")
    token_prompts = prompts(384, (20, 23, 26, 29), seed=3)
    params = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
    alone = make_llm(path, block_size=8)
    try:
        ref = [alone.beam_search([{"prompt_token_ids": p}], params)[0] for p in token_prompts]
    finally:
        alone.shutdown()
    # 22 blocks of 8 tokens (768 bytes a token): about two groups of 11 blocks; 16: one group
    # at a time, readmitted with nothing running (it used to wait forever for blocks no one
    # would free, or hold some beams while the rest could not come in)
    tight = make_llm(path, block_size=8, kv_cache_memory=blocks * 8 * 768, max_model_len=64)
    try:
        got = tight.beam_search([{"prompt_token_ids": p} for p in token_prompts], params)
        assert tight.llm_engine.scheduler.num_preemptions > 0
        assert _held(tight.llm_engine) == 0
    finally:
        tight.shutdown()
    for r, g in zip(ref, got):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in r.sequences]
        torch.testing.assert_close([s.cum_logprob for s in g.sequences],
                                   [s.cum_logprob for s in r.sequences], atol=1e-4, rtol=0)


def test_a_group_wider_than_max_num_seqs_is_refused(tmp_path):
    path = build_family(tmp_path / "m", "Qwen3ForCausalLM")
    llm = make_llm(path, block_size=8, max_num_seqs=4)
    try:
        with pytest.raises(InvalidRequestError, match="max_num_seqs"):
            llm.llm_engine.add_request("wide", [5, 6, 7], beam_params(6, 4))
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_a_group_the_whole_cache_cannot_hold_is_refused(tmp_path):
    """Admitted and preempted whole, a group must fit the pool when all its beams diverge."""
    path = build_family(tmp_path / "m", "LlamaForCausalLM")
    llm = make_llm(path, block_size=8, kv_cache_memory=12 * 8 * 768, max_model_len=64)
    try:
        with pytest.raises(InvalidRequestError, match="beam search of width 4 needs up to 14"):
            llm.llm_engine.add_request("big", list(range(5, 28)), beam_params(4, 10))
        assert not llm.llm_engine.has_unfinished_requests()
        llm.llm_engine.add_request("fits", list(range(5, 28)), beam_params(2, 10))  # 2 + 2 x 3
    finally:
        llm.shutdown()

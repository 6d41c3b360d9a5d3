"""Speculative decoding over the KV cache's other modes (tiny random Llama, fp32 weights):
swap preemption, the FP8 KV cache, the host tier and tensor parallelism. Each runs the oracle
proposer of test_spec_decode.py (accepted runs of every length and rejections at every
position) against the same engine configuration without speculation: greedy tokens equal,
drafts accepted and rejected, no block held at the end."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm
from forked_workers import forked_workers
from test_spec_decode import (PROMPTS, Oracle, assert_no_blocks_held, counters, same,
                              spec_llm, with_oracle)

from kvserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Tensor-parallel workers fork from a preloaded fork server (forked_workers.py):
    no import of torch and transformers each."""
    with forked_workers():
        yield


def drafted_both_ways(llm) -> None:
    """Some drafts were kept and some refused: the rollback and the keep paths both ran."""
    _, drafted, accepted, _ = counters(llm)
    assert 0 < accepted < drafted


def test_swap_preemption_with_drafts(tiny_model_dir):
    """Blocks of seqs swapped out to the host and back hold only kept tokens: outputs equal
    the same swapping engine's without speculation."""
    prompts = [p * 3 for p in PROMPTS] * 2
    small = dict(kv_cache_memory=None, num_gpu_blocks_override=24, block_size=8,
                 max_num_seqs=8, preemption_mode="swap", swap_space=0.01)
    base = make_llm(tiny_model_dir, **small)
    llm = with_oracle(spec_llm(tiny_model_dir, **small), base, prompts, GREEDY)
    same(base.generate(prompts, GREEDY, use_tqdm=False),
         llm.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.offload_bytes_to_host > 0
    assert stats.offload_bytes_to_device == stats.offload_bytes_to_host  # all swapped back
    drafted_both_ways(llm)
    assert_no_blocks_held(llm)


def test_fp8_kv_cache_with_drafts(tiny_model_dir):
    """Drafts' K/V are quantised into the FP8 cache like any token's, and a rejected draft's
    slot is written over by the next step: the same tokens as FP8 decoding without drafts."""
    kw = dict(kv_cache_dtype="fp8", block_size=8)
    base = make_llm(tiny_model_dir, **kw)
    llm = with_oracle(spec_llm(tiny_model_dir, **kw), base, PROMPTS, GREEDY)
    assert llm.llm_engine.core.runner.kv.dtype == torch.float8_e4m3fn
    same(base.generate(PROMPTS, GREEDY, use_tqdm=False),
         llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    drafted_both_ways(llm)
    assert_no_blocks_held(llm)


def test_host_tier_restores_blocks_filled_by_drafts(tiny_model_dir):
    """Blocks completed by accepted drafts are registered under their hashes, offloaded to the
    host tier when evicted, and restored for a later prompt that extends the output: equal
    outputs, and host-tier hits that cover the drafted part."""
    kw = dict(kv_cache_memory=None, num_gpu_blocks_override=24, block_size=8,
              kv_offloading_size=0.01)
    base = make_llm(tiny_model_dir, **kw)
    llm = spec_llm(tiny_model_dir, **kw)
    first = []
    for p in PROMPTS:  # one at a time: each request's blocks are evicted by the next ones
        with_oracle(llm, base, [p], GREEDY)
        first += llm.generate([p], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == \
        [o.outputs[0].token_ids for o in base.generate(PROMPTS, GREEDY, use_tqdm=False)]
    ids = list(first[0].prompt_token_ids) + list(first[0].outputs[0].token_ids)
    longer = [{"prompt_token_ids": ids}]
    with_oracle(llm, base, longer, GREEDY)
    hits, host_hits = (llm.llm_engine.get_stats().prefix_cache_hits,
                       llm.llm_engine.get_stats().prefix_cache_host_hits)
    same(base.generate(longer, GREEDY, use_tqdm=False),
         llm.generate(longer, GREEDY, use_tqdm=False))
    stats = llm.llm_engine.get_stats()
    full_blocks = (len(ids) - 1) // 8  # the last prompt token is always computed
    assert stats.prefix_cache_hits - hits == 8 * full_blocks  # drafted blocks included
    # from the host tier: more than the first prompt's own blocks, i.e. blocks whose tokens
    # were decoded (most of them drafted and accepted)
    assert stats.prefix_cache_host_hits - host_hits > 8 * (len(first[0].prompt_token_ids) // 8)
    drafted_both_ways(llm)
    assert_no_blocks_held(llm)


def test_tensor_parallel_with_drafts(tiny_model_dir):
    """TP=2 (two ranks, gloo): the verification forward is a chunk like any other, sharded the
    same way; the tokens equal TP=2 without speculation."""
    base = make_llm(tiny_model_dir, tensor_parallel_size=2, block_size=8)
    expected = base.generate(PROMPTS, GREEDY, use_tqdm=False)
    base.shutdown()  # one tensor-parallel engine per process at a time
    llm = spec_llm(tiny_model_dir, tensor_parallel_size=2, block_size=8)
    try:
        llm.llm_engine.core.spec.proposer = Oracle(
            {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
             for o in expected})
        same(expected, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        drafted_both_ways(llm)
        assert_no_blocks_held(llm)
    finally:
        llm.shutdown()

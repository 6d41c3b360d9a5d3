"""Sliding windows in the KV cache, end to end on a tiny random Gemma 3 (window 11, shorter
than the prompts): the engine releases blocks that left every window of a request, so more
requests run at once in the same KV memory, and tokens and logprobs stay HF's (fp32, eager)
through chunked prefill across the window, preemption (recompute and swap) and the host tier."""

from __future__ import annotations

import pytest

from conftest import make_llm
from family_checks import assert_matches_hf, build_family, hf_model, prompts
from kvserve import SamplingParams

LAYERS = ["sliding_attention"] * 3 + ["full_attention"]  # Gemma 3's pattern, shortened
KV_MEMORY = 24 * 4 * 2048  # 24 blocks of 8 tokens over all 4 layers (2 KiB a layer-block)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("gemma3"), "Gemma3ForCausalLM",
                        layer_types=LAYERS, num_hidden_layers=4, sliding_window=11,
                        query_pre_attn_scalar=24)


@pytest.fixture(scope="module")
def hf(gemma3_dir):
    return hf_model(gemma3_dir)


def engine_run(llm, token_prompts: list[list[int]]) -> tuple[list, int, int]:
    """Step the engine by hand: (outputs in prompt order, most requests running at once,
    most KV bytes held at once)."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1, ignore_eos=True)
    for i, p in enumerate(token_prompts):
        engine.add_request(str(i), p, sp)
    done, peak_running, peak_bytes = {}, 0, 0
    per_block = engine.memory_budget.bytes_per_block
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        peak_running = max(peak_running, len(engine.scheduler.running))
        held = engine.kv.pool.num_blocks - engine.kv.num_free_blocks
        peak_bytes = max(peak_bytes, held * per_block)
    return [done[i] for i in range(len(token_prompts))], peak_running, peak_bytes


@pytest.mark.slow
def test_windows_free_blocks_and_admit_more_requests_with_hf_results(gemma3_dir, hf):
    token_prompts = prompts(hf.config.vocab_size, (37,) * 5)
    runs = {}
    for hybrid in (True, False):
        llm = make_llm(gemma3_dir, block_size=8, max_num_batched_tokens=16, max_num_seqs=16,
                       kv_cache_memory=KV_MEMORY, enable_prefix_caching=False,
                       preemption_mode="recompute",
                       disable_hybrid_kv_cache_manager=not hybrid)
        try:
            assert llm.llm_engine.kv.groups.is_hybrid == hybrid
            one, _, one_bytes = engine_run(llm, token_prompts[:1])  # a long generation alone
            many, running, _ = engine_run(llm, token_prompts)
            runs[hybrid] = (one, one_bytes, many, running,
                            llm.llm_engine.scheduler.num_preemptions)
        finally:
            llm.shutdown()
    (one_h, bytes_h, many_h, running_h, preempted_h), \
        (one_b, bytes_b, many_b, running_b, preempted_b) = runs[True], runs[False]
    # 52 tokens computed in blocks of 8: 7 blocks of 4 layers without the windows; with them the
    # full layer keeps its 7 and each sliding layer at most 4 (a 16-token chunk and the 10 keys
    # before it).
    assert bytes_b == 7 * 4 * 2048 and bytes_h <= (7 + 3 * 4) * 2048
    # The same KV bytes: 24 blocks cannot hold 5 requests of 7 blocks, so some are preempted;
    # 96 pages hold all 5 (at most 19 pages each) at once.
    assert preempted_b > 0 and preempted_h == 0 and running_h == 5 >= running_b
    for outs in (one_h, one_b, many_h, many_b):
        assert_matches_hf(hf, token_prompts[:len(outs)], outs)
    assert [o.outputs[0].token_ids for o in many_h] == [o.outputs[0].token_ids for o in many_b]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_windows_matches_hf(gemma3_dir, hf, mode):
    token_prompts = prompts(hf.config.vocab_size, (37, 29, 41, 33, 23), seed=11)
    llm = make_llm(gemma3_dir, block_size=8, max_num_batched_tokens=16, max_num_seqs=8,
                   kv_cache_memory=60 * 2048, preemption_mode=mode, swap_space=0.01)
    try:
        outs, _, _ = engine_run(llm, token_prompts)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        if mode == "swap":
            assert llm.llm_engine.kv.num_cpu_blocks > 0
        assert_matches_hf(hf, token_prompts, outs)
    finally:
        llm.shutdown()


def test_host_tier_promotes_every_groups_blocks(gemma3_dir, hf):
    first, *others = prompts(hf.config.vocab_size, (37,) * 5, seed=13)
    llm = make_llm(gemma3_dir, block_size=8, max_num_batched_tokens=16, max_num_seqs=8,
                   kv_cache_memory=60 * 2048, kv_offloading_size=0.001)
    try:
        cold, _, _ = engine_run(llm, [first])
        engine_run(llm, others)  # evicts `first`'s cached blocks to the host tier
        warm, _, _ = engine_run(llm, [first])
        assert llm.llm_engine.kv.prefix_stats.host_hits > 0
        assert warm[0].num_cached_tokens == 32
        assert warm[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
        assert_matches_hf(hf, [first], warm)
    finally:
        llm.shutdown()


def test_disk_tier_serves_every_groups_blocks(gemma3_dir, hf, tmp_path):
    # As above with a host tier of 3 pages: `first`'s pages go on to the disk tier, and every
    # group's (keyed by hash and group) come back from their files with the same tokens.
    first, *others = prompts(hf.config.vocab_size, (37,) * 5, seed=13)
    llm = make_llm(gemma3_dir, block_size=8, max_num_batched_tokens=16, max_num_seqs=8,
                   kv_cache_memory=60 * 2048, kv_offloading_size=3 * 2048 / (1 << 30),
                   kv_offloading_disk_path=str(tmp_path / "kv"),
                   kv_offloading_disk_size=400 * 2048 / (1 << 30))
    try:
        cold, _, _ = engine_run(llm, [first])
        engine_run(llm, others)
        llm.llm_engine.kv.disk.flush()
        warm, _, _ = engine_run(llm, [first])
        kv = llm.llm_engine.kv
        assert kv.prefix_stats.disk_hits == 32 and kv.disk.num_bad_files == 0
        assert warm[0].num_cached_tokens == 32
        assert warm[0].outputs[0].token_ids == cold[0].outputs[0].token_ids
        assert_matches_hf(hf, [first], warm)
    finally:
        llm.shutdown()

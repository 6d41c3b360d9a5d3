"""fp8 (e4m3) KV cache with the host and disk tiers on the tiny random Llama: evicted prefixes come
back through the tiers (which copy fp8 as bytes) token-identical to the fp8 cache without tiers."""

from __future__ import annotations

import random

import pytest
from conftest import make_llm

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_offload import disk_block_file as fmt

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16
FP8_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16  # K/V, layers, tokens, KV heads, head_dim, 1 byte


def tenant_prompts(tenants: int = 3) -> list[list[int]]:
    """Two rounds of tenants with a 5-block prefix each: 15 prefix blocks against a 12-block
    device pool, so each prefix is evicted before the tenant's second turn."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 380) for _ in range(5 * BLOCK)] for _ in range(tenants)]
    return [prefixes[t] + [rng.randrange(3, 380) for _ in range(5)]
            for _ in range(2) for t in range(tenants)]


def run_turns(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One request at a time: output tokens and cached tokens of each (disk writes drained)."""
    engine, toks, cached = llm.llm_engine, [], []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        toks.append(list(final.outputs[0].token_ids))
        cached.append(final.num_cached_tokens)
        if getattr(engine, "disk", None) is not None:
            engine.disk.flush()
    return toks, cached


@pytest.fixture(scope="module")
def fp8_reference(tiny_model_dir) -> list[list[int]]:
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=12, kv_cache_dtype="fp8",
                   enable_prefix_caching=False)
    return run_turns(llm, tenant_prompts())[0]


def test_fp8_kv_through_the_host_tier_is_token_identical(tiny_model_dir, fp8_reference):
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=12, kv_cache_dtype="fp8",
                   kv_offloading_size=0.01)
    toks, cached = run_turns(llm, tenant_prompts())
    assert toks == fp8_reference
    assert cached == [0, 0, 0] + [5 * BLOCK] * 3  # the second turns hit every prefix block
    stats = llm.llm_engine.get_stats()
    assert stats.host_blocks_restored == 12  # 4 of each prefix's 5 blocks came back from host
    assert stats.offload_bytes_to_device == 12 * FP8_BLOCK_BYTES


def test_fp8_kv_through_the_disk_tier_is_token_identical(tiny_model_dir, tmp_path, fp8_reference):
    host_gib = 2 * FP8_BLOCK_BYTES / (1 << 30)  # two host slots: the rest goes to disk
    disk_gib = 64 * (FP8_BLOCK_BYTES + fmt.HEADER_SIZE) / (1 << 30)
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=12, kv_cache_dtype="fp8",
                   kv_offloading_size=host_gib, kv_offloading_disk_path=str(tmp_path),
                   kv_offloading_disk_size=disk_gib)
    toks, cached = run_turns(llm, tenant_prompts())
    assert toks == fp8_reference
    assert cached == [0, 0, 0] + [5 * BLOCK] * 3
    assert llm.llm_engine.get_stats().disk_blocks_restored > 0

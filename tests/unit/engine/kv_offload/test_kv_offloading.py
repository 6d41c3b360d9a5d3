"""KV host tier and auto swap on the tiny random Llama: tenants whose prefixes do not fit the
device pool together get the same tokens with and without the tier, the tier's restores count as
cached tokens, and "auto" preemption resumes sequences identically whichever way it decides."""

from __future__ import annotations

import random

import pytest
from conftest import make_llm

from kvserve import LLM, SamplingParams
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_offload.swap_cost import SwapCostModel

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16


def tenant_prompts(rounds: int = 2, tenants: int = 3) -> list[list[int]]:
    """Round-robin turns of tenants with a 5-block prefix each: 15 prefix blocks, more than the
    12-block device pool holds, so each tenant's prefix is evicted before its next turn."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 380) for _ in range(5 * BLOCK)] for _ in range(tenants)]
    return [prefixes[t] + [rng.randrange(3, 380) for _ in range(5)]
            for _ in range(rounds) for t in range(tenants)]


def run_turns(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY
              ) -> tuple[list[list[int]], list[int]]:
    """One request at a time (a chat's turns): output tokens and cached tokens of each. A disk
    tier's writer is drained between turns, so the next turn's reads hit files."""
    engine, toks, cached = llm.llm_engine, [], []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        toks.append(final.outputs[0].token_ids)
        cached.append(final.num_cached_tokens)
        if getattr(engine, "disk", None) is not None:
            engine.disk.flush()
    return toks, cached


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The same turns with no prefix cache at all: what every run must produce."""
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=12, enable_prefix_caching=False)
    return run_turns(llm, tenant_prompts())[0]


def test_evicted_prefixes_come_back_from_the_host_tier_with_identical_outputs(
        tiny_model_dir, reference):
    prompts = tenant_prompts()
    plain = make_llm(tiny_model_dir, num_gpu_blocks_override=12)
    tiered = make_llm(tiny_model_dir, num_gpu_blocks_override=12, kv_offloading_size=0.01)
    plain_toks, plain_cached = run_turns(plain, prompts)
    tier_toks, tier_cached = run_turns(tiered, prompts)
    assert plain_toks == tier_toks == reference
    # Without the tier the device pool keeps only each prefix's first block (freed last).
    assert plain_cached == [0, 0, 0, BLOCK, BLOCK, BLOCK]
    assert tier_cached == [0, 0, 0, 5 * BLOCK, 5 * BLOCK, 5 * BLOCK]  # restored: all 5 blocks
    stats = tiered.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 3 * 5 * BLOCK
    assert stats.prefix_cache_host_hits == 3 * 4 * BLOCK  # the first blocks were on the device
    assert stats.host_blocks_restored == 12 and stats.host_blocks_stored >= 12
    block_bytes = tiered.llm_engine.memory_budget.bytes_per_block
    assert stats.offload_bytes_to_device == 12 * block_bytes
    assert stats.offload_bytes_to_host == stats.host_blocks_stored * block_bytes
    assert 0 < stats.cpu_cache_usage <= 1
    restores = tiered.llm_engine.drain_restore_seconds()
    assert len(restores) == 3 and all(s >= 0 for s in restores)  # one batched restore per turn


def test_host_tier_events_hashes_and_reset(tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=12, kv_offloading_size=0.01)
    engine = llm.llm_engine
    run_turns(llm, tenant_prompts(rounds=1))
    device_only = engine.drain_kv_events()
    assert device_only and {e.medium for e in device_only} == {"device"}
    host_events = engine.drain_kv_events(("host",))
    stored = [h for e in host_events if e.kind == "stored" for h in e.block_hashes]
    assert {e.medium for e in host_events} == {"host"}
    assert sorted(stored) == sorted(engine.cached_block_hashes("host"))
    assert set(stored).isdisjoint(engine.cached_block_hashes())  # evicted from the device
    assert engine.reset_prefix_cache()
    assert engine.cached_block_hashes("host") == []
    assert [e.kind for e in engine.drain_kv_events(("host",))] == ["cleared"]


def test_a_host_tier_smaller_than_the_working_set_stays_correct(tiny_model_dir, reference):
    """Two blocks of host memory: most prefixes are lost, nothing is ever wrong."""
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=12)
    engine = llm.llm_engine
    from kvserve.engine.kv_offload.host_blocks import HostBlocks
    from kvserve.engine.kv_offload.host_tier import HostTier

    engine.kv.host = HostTier(2)  # as kv_offloading_size of two blocks would build it
    engine.runner.host = HostBlocks(engine.runner.kv, 2)
    toks, cached = run_turns(llm, tenant_prompts())
    assert toks == reference
    stats = engine.get_stats()
    assert stats.num_host_cached_blocks == 2 and stats.host_blocks_evicted > 0
    assert sum(cached) == stats.prefix_cache_hits < 3 * 5 * BLOCK


@pytest.mark.parametrize("decide", ["swap", "recompute"])
def test_auto_preemption_resumes_identically(tiny_model_dir, decide):
    """The default mode: a tiny pool preempts; the cost model's answer is forced each way."""
    prompts = [[7 + i] * 40 + list(range(10, 30)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = make_llm(tiny_model_dir, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in ref.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=10, swap_space=0.01,
                   enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine.config.preemption_mode == "auto" and engine.kv.num_cpu_blocks == 10
    cost = engine.swap_cost
    cost.copy_bytes_per_s = 1e12 if decide == "swap" else 1.0  # pinned: _ALPHA only moves it
    cost.prefill_tokens_per_s = 1.0 if decide == "swap" else 1e12
    cost.observe_copy = cost.observe_prefill = lambda *a: None  # type: ignore[method-assign]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    swapped = stats.offload_bytes_to_host > 0
    assert swapped == (decide == "swap")
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks


def test_swap_cost_model():
    cost = SwapCostModel(bytes_per_block=1000)
    assert cost.prefer_swap(10, 1) and cost.crossover_tokens_per_block() is None  # unknown
    cost.observe_copy(1_000_000, 1.0)  # 1 MB/s: a block out and back in costs 2 ms
    cost.observe_prefill(1000, 1.0)  # 1000 tokens/s: a token costs 1 ms
    assert cost.swap_seconds(3) == pytest.approx(0.006)
    assert cost.recompute_seconds(16) == pytest.approx(0.016)
    assert cost.crossover_tokens_per_block() == pytest.approx(2.0)
    assert cost.prefer_swap(1, 16) and not cost.prefer_swap(1, 1)
    cost.observe_copy(0, 1.0)  # nothing moved: ignored
    cost.observe_copy(2_000_000, 1.0)
    assert cost.copy_bytes_per_s == pytest.approx(1.2e6)  # a moving average, not the last


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_offloading_size": -1}, "kv_offloading_size must be >= 0"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ({"preemption_mode": "evict"}, "preemption_mode must be one of"),
    ({"kv_offloading_size": 1e-9}, "holds no KV block"),
])
def test_bad_tier_settings_are_refused(tiny_model_dir, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_llm(tiny_model_dir, **kwargs)

"""Adapters in the engine against HF + peft (merged, fp32): greedy tokens and teacher-forced
logprobs of one batch mixing four adapters and the base model, with more adapters than
max_loras (slots reused) and than max_cpu_loras (adapters read again); the prefix cache never
shares blocks across adapters; tensor parallelism (2 ranks) gives the same as one."""

from __future__ import annotations

import pytest

from conftest import make_llm
from family_checks import assert_matches_hf, prompts
from kvserve import SamplingParams
from kvserve.engine.core.block_hash import block_hashes, extra_keys_for
from kvserve.lora.request import LoRARequest
from lora_checks import adapters, lora_base, merged_model  # noqa: F401 - fixtures

TOKENS = 6


def _generate(llm, token_prompts, loras):
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=1, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in token_prompts], sp, use_tqdm=False,
                        lora_request=loras)


def _requests(adapters):
    return [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]


@pytest.fixture(scope="module")
def llm(lora_base):
    llm = make_llm(lora_base, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8,
                   block_size=8, max_num_batched_tokens=32)
    yield llm
    llm.shutdown()


def test_mixed_batch_matches_hf_peft_merged(llm, lora_base, adapters):
    token_prompts = prompts(300, lens=(5, 19))
    reqs = [None, *_requests(adapters)]  # base + 4 adapters; 2 device slots, 3 in host memory
    items = [p for p in token_prompts for _ in reqs]
    loras = [r for _ in token_prompts for r in reqs]
    outs = _generate(llm, items, loras)
    for k, req in enumerate(reqs):
        hf = merged_model(lora_base, adapters[k - 1] if req is not None else None)
        assert_matches_hf(hf, token_prompts, outs[k::len(reqs)])
    by_adapter = [[o.outputs[0].token_ids for o in outs[k::len(reqs)]] for k in range(len(reqs))]
    assert len({str(t) for t in by_adapter}) == len(reqs)  # every adapter changes the output
    assert llm.llm_engine.lora.load_seconds and len(llm.llm_engine.lora.host) <= 3


def test_prefix_cache_is_keyed_by_adapter(llm, adapters):
    prompt = [prompts(300, lens=(40,), seed=9)[0]]
    a0, a1 = _requests(adapters)[:2]
    first = _generate(llm, prompt, a0)[0]
    again = _generate(llm, prompt, a0)[0]
    other = _generate(llm, prompt, a1)[0]
    base = _generate(llm, prompt, None)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    # vLLM's RequestOutput.lora_request: the adapter each output ran with
    assert (first.lora_request, other.lora_request, base.lora_request) == (a0, a1, None)
    ids = prompt[0]
    assert block_hashes(ids, 8, extra_keys_for(None, "a0")) != \
        block_hashes(ids, 8, extra_keys_for(None, "a1"))
    assert block_hashes(ids, 8, extra_keys_for(None, None)) == block_hashes(ids, 8)
    from kvserve.service.prefix_index.extra_keys import block_extra_keys  # the router's

    for salt, name in ((None, None), ("s", None), (None, "a0"), ("s", "a1")):
        assert extra_keys_for(salt, name) == block_extra_keys(salt, name)


def test_slots_of_running_adapters_are_never_evicted(llm, adapters):
    """Three adapters' requests at once with two slots: the third waits for a slot, and each
    request's output equals the one it gets alone (a reused slot would change it)."""
    reqs = _requests(adapters)[:3]
    token_prompts = prompts(300, lens=(7, 9, 11), seed=4)
    together = _generate(llm, token_prompts, reqs)
    alone = [_generate(llm, [p], r)[0] for p, r in zip(token_prompts, reqs)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_tensor_parallel_matches_one_rank(lora_base, adapters, llm):
    reqs = [None, *_requests(adapters)]
    token_prompts = prompts(300, lens=(6, 13), seed=2)
    items = [p for p in token_prompts for _ in reqs]
    loras = [r for _ in token_prompts for r in reqs]
    want = _generate(llm, items, loras)
    tp = make_llm(lora_base, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
                  tensor_parallel_size=2)
    try:
        got = _generate(tp, items, loras)
    finally:
        tp.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            (ta, la), = [(t, v.logprob) for t, v in a.items()][:1]
            assert abs(la - b[ta].logprob) < 1e-4


async def test_async_llm_runs_adapters_on_the_engine_thread(lora_base, adapters, llm):
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.config import EngineConfig

    a0 = _requests(adapters)[0]
    prompt = prompts(300, lens=(9,), seed=3)[0]
    want = _generate(llm, [prompt], a0)[0].outputs[0].token_ids
    engine = AsyncLLM(AsyncEngine.from_config(EngineConfig(
        model=str(lora_base), dtype="float32", device="cpu", kv_cache_memory=1 << 22,
        enable_lora=True, max_loras=1, max_lora_rank=8)))
    try:
        assert await engine.add_lora(a0) is True
        assert [r.lora_name for r in await engine.list_loras()] == ["a0"]
        sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        last = None
        async for out in engine.generate({"prompt_token_ids": prompt}, sp, "r0",
                                         lora_request=a0):
            last = out
        assert last.outputs[0].token_ids == want
        assert engine.engine.resident_loras() == ["a0"]
        assert await engine.remove_lora("a0") is True
    finally:
        engine.shutdown()

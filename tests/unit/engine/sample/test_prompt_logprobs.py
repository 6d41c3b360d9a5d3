"""Prompt logprobs (SamplingParams(prompt_logprobs=k)) on the tiny random Llama, against HF
transformers' log_softmax of the logits at every prompt position: with chunked prefill, next to
requests that do not ask them, after a prefix-cache hit, across preemption by recompute, with
n > 1 / best_of and with two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
from kvserve import LLM, Logprob, SamplingParams
from kvserve.engine.errors import InvalidRequestError
from transformers import AutoModelForCausalLM

# Long enough to span several 16-token blocks and several 32-token prefill chunks.
LONG = ("Paged attention stores the KV cache in fixed-size blocks, like virtual memory pages. "
        "Explain how the KV cache works in a transformer language model. The quick brown fox.")
PROMPTS = [LONG, "What is the capital of France? The capital of France is Paris.",
           "Hello world"]


def make_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    kw.setdefault("max_num_batched_tokens", 32)  # every prompt here but the last is chunked
    return LLM(str(path), dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """prompt ids -> HF's log_softmax over the vocabulary at every position, float64."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return run


def params(k: int | None = 3, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 4)
    return SamplingParams(temperature=0, prompt_logprobs=k, ignore_eos=True, **kw)


def check_against_hf(out, ref: torch.Tensor, k: int) -> None:
    """One entry per prompt token (None first); each holds the actual token with its logprob
    and rank, and the k most likely tokens with ranks 1..k, all as HF computes them."""
    ids, lps = out.prompt_token_ids, out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for j in range(1, len(ids)):
        row, tok, entry = ref[j - 1], ids[j], lps[j]
        assert all(isinstance(e, Logprob) for e in entry.values())
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        better = int((row > row[tok] + 1e-5).sum())
        assert better + 1 <= entry[tok].rank <= int((row >= row[tok] - 1e-5).sum())
        top = sorted((e for e in entry.values() if e.rank <= k), key=lambda e: e.rank)
        assert [e.rank for e in top] == list(range(1, k + 1))
        assert len(entry) == k + (entry[tok].rank > k)
        want = row.topk(k).values.tolist()
        assert [e.logprob for e in top] == pytest.approx(want, abs=1e-4)
        for tid, e in entry.items():
            assert e.logprob == pytest.approx(float(row[tid]), abs=1e-4)


def test_prompt_logprobs_equal_hf_with_chunked_prefill(llm, hf_logprobs):
    outs = llm.generate(PROMPTS, params(3), use_tqdm=False)
    assert len(outs[0].prompt_token_ids) > 64  # three chunks of 32 at least
    for out in outs:
        check_against_hf(out, hf_logprobs(out.prompt_token_ids), 3)
        assert out.outputs[0].logprobs is None  # only the prompt's were asked
    decoded = outs[1].prompt_logprobs[1][outs[1].prompt_token_ids[1]].decoded_token
    assert decoded == llm.get_tokenizer().decode([outs[1].prompt_token_ids[1]])


def test_k_zero_holds_the_actual_token_only(llm, hf_logprobs):
    out = llm.generate(PROMPTS[1], params(0), use_tqdm=False)[0]
    ref = hf_logprobs(out.prompt_token_ids)
    for j, entry in enumerate(out.prompt_logprobs[1:], 1):
        (tok, lp), = entry.items()
        assert tok == out.prompt_token_ids[j]
        assert lp.logprob == pytest.approx(float(ref[j - 1, tok]), abs=1e-4)


def test_plain_requests_in_the_same_batch_are_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [params(5, max_tokens=12)] * 3,
                         use_tqdm=False)
    for a, m in zip(alone, mixed[:3]):
        assert m.prompt_logprobs is None
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].logprobs == a.outputs[0].logprobs
    for a, m in zip(alone, mixed[3:]):  # asking prompt logprobs changes nothing generated
        assert m.outputs[0].token_ids == a.outputs[0].token_ids


def test_no_prefix_cache_hits_for_a_request_owed_prompt_logprobs(tiny_model_dir, hf_logprobs):
    llm = make_llm(tiny_model_dir)
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(LONG, plain, use_tqdm=False)
    assert llm.generate(LONG, plain, use_tqdm=False)[0].num_cached_tokens > 0  # cached now
    out = llm.generate(LONG, params(3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # computed in full: a cached block has no hidden states
    check_against_hf(out, hf_logprobs(out.prompt_token_ids), 3)
    assert llm.generate(LONG, plain, use_tqdm=False)[0].num_cached_tokens > 0  # still cached


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_one_entry_per_prompt_token(tiny_model_dir, hf_logprobs, mode):
    # 12 blocks for four 81-token prompts: seqs are preempted in the middle of their prefill
    small = make_llm(tiny_model_dir, num_gpu_blocks_override=12, preemption_mode=mode,
                     swap_space=0.01, enable_prefix_caching=False)
    outs = small.generate([f"{LONG} {i}" for i in range(4)], params(2, max_tokens=40),
                          use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions > 0
    for out in outs:
        check_against_hf(out, hf_logprobs(out.prompt_token_ids), 2)


def test_n_and_best_of_compute_them_once(llm, hf_logprobs):
    sampled = dict(temperature=1.0, seed=7, max_tokens=5)
    for sp in (SamplingParams(n=3, prompt_logprobs=2, **sampled),
               SamplingParams(n=2, best_of=4, prompt_logprobs=2, **sampled)):
        out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
        assert len(out.outputs) == sp.n
        check_against_hf(out, hf_logprobs(out.prompt_token_ids), 2)


def test_a_one_token_prompt_has_only_the_leading_none(llm):
    out = llm.generate([[5]], params(2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_out_of_range_is_refused():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_two_tensor_parallel_ranks(tiny_model_dir, hf_logprobs):
    tp = make_llm(tiny_model_dir, tensor_parallel_size=2)
    try:
        out = tp.generate(PROMPTS[0], params(3), use_tqdm=False)[0]
    finally:
        tp.shutdown()
    check_against_hf(out, hf_logprobs(out.prompt_token_ids), 3)

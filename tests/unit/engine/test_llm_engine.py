"""LLMEngine / LLM on the tiny random Llama: HF equality, prefix caching, preemption, forks,
bad input. Fast; the real default model is covered in tests/integration."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.engine.errors import (ConfigError, InvalidRequestError, ModelNotFoundError,
                                   RequestFailedError)

PROMPTS = [
    "Hello world",
    "What is the capital of France? The capital",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Paged attention stores the KV cache in fixed-size blocks",
    "You are a helpful assistant. Answer briefly and precisely.",
    "0123456789 abcdefghijklmnopqrstuvwxyz",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        gen = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_hf_one_at_a_time_and_batched(llm, hf_greedy):
    one = [tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    batched = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert one == hf_greedy
    assert batched == hf_greedy


def test_outputs_keep_input_order_and_fields(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.prompt_token_ids == tok(o.prompt)["input_ids"]
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_prefix_caching_on_and_off_give_identical_outputs(tiny_model_dir, hf_greedy):
    shared = "You are a helpful assistant. " * 6
    prompts = [shared + p for p in PROMPTS]
    on = make_llm(tiny_model_dir, enable_prefix_caching=True)
    off = make_llm(tiny_model_dir, enable_prefix_caching=False)
    first = tokens(on.generate(prompts, GREEDY, use_tqdm=False))
    before = on.llm_engine.get_stats()
    again = tokens(on.generate(prompts, GREEDY, use_tqdm=False))
    after = on.llm_engine.get_stats()
    plain = tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    assert first == again == plain
    # The second pass finds every full prompt block in the cache.
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    assert hits / queries > 0.8
    assert off.llm_engine.get_stats().prefix_cache_hits == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_kv_budget_preempts_and_gives_identical_outputs(tiny_model_dir, hf_greedy, mode):
    small = make_llm(tiny_model_dir, num_gpu_blocks_override=10, preemption_mode=mode,
                     swap_space=0.01, enable_prefix_caching=False)
    outs = tokens(small.generate(PROMPTS, GREEDY, use_tqdm=False))
    stats = small.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert outs == hf_greedy
    assert stats.num_free_blocks == stats.num_total_blocks


def test_parallel_sampling_is_seeded_and_shares_prompt_blocks(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[2] * 2  # > 2 full blocks
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    b = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the samples differ
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]

    engine = llm.llm_engine
    engine.add_request("fork", prompt, params)
    engine.step()  # prefill + 4 samples -> parent forked into 4 sequences
    seqs = engine.requests["fork"].seqs
    assert len(seqs) == 4
    tables = [engine.kv.tables[s.seq_id] for s in seqs]
    n_full = len(engine.requests["fork"].prompt_token_ids) // engine.block_size
    for i in range(n_full):
        assert len({t[i].block_id for t in tables}) == 1 and tables[0][i].ref_cnt == 4
    engine.step()  # each sample writes its own token: copy-on-write of the shared last block
    last = {engine.kv.tables[s.seq_id][-1].block_id for s in seqs}
    assert len(last) == 4
    engine.abort_request("fork")
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_seed_reproducible_regardless_of_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=16,
                            ignore_eos=True)
    alone = tokens(llm.generate(PROMPTS[1], seeded, use_tqdm=False))[0]
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [other, seeded, other],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_stop_strings_and_stop_token_ids(llm, hf_greedy):
    tok = llm.get_tokenizer()
    full = tok.decode(hf_greedy[1], skip_special_tokens=True)
    stop = full[5:9]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]
    stop_tok = hf_greedy[1][3]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24,
                                                  stop_token_ids=[stop_tok], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy[1][: hf_greedy[1].index(stop_tok) + 1]
    assert out.stop_reason == stop_tok


def test_logprobs_match_hf(llm, tiny_model_dir, hf_greedy):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    full = torch.cat([ids, torch.tensor([out.token_ids])], dim=1)
    with torch.no_grad():
        lp = torch.log_softmax(hf(full).logits[0].float(), -1)
    assert len(out.logprobs) == 4
    for i, (t, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = lp[ids.shape[1] - 1 + i]
        assert len(entry) == 3 or (t in row.topk(3).indices.tolist() and len(entry) == 3)
        # vLLM's Logprob objects: the value, and the rank in the whole vocabulary
        assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert entry[t].rank == int((row >= row[t]).sum())
        for rank, k in enumerate(row.topk(3).indices.tolist(), start=1):
            assert entry[k].logprob == pytest.approx(row[k].item(), abs=1e-4)
            assert entry[k].rank == rank
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                       zip(out.token_ids, out.logprobs)))


def test_bad_inputs_are_typed_errors_and_engine_keeps_serving(llm, hf_greedy):
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("", GREEDY, use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate("word " * 600, GREEDY, use_tqdm=False)
    assert e.value.param == "prompt" and "max_model_len" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=0)
    assert e.value.param == "max_tokens"
    # max_tokens past the context: the output stops there (vLLM v1's engine; the server's 400
    # for it is tests/integration/test_api_server.py's)
    capped = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10_000, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(capped.prompt_token_ids) + len(capped.outputs[0].token_ids) == \
        engine.max_model_len and capped.outputs[0].finish_reason == "length"
    engine.add_request("ok", PROMPTS[1], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("ok", PROMPTS[1], GREEDY)  # duplicate id
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == hf_greedy[1]


def test_offline_generate_raises_when_a_request_fails_in_a_step(llm, hf_greedy):
    bad = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = llm.llm_engine
    original = engine.add_request

    def add_then_break(request_id, prompt, params, *a, **kw):  # accepted, then made impossible
        out = original(request_id, prompt, params, *a, **kw)
        if params is bad:
            params.seed = 2**70
        return out

    engine.add_request = add_then_break
    try:
        with pytest.raises(RequestFailedError, match="1 of 2 requests failed.*prompt #1") as info:
            llm.generate(PROMPTS[:2], [good, bad], use_tqdm=False)
    finally:
        del engine.add_request
    assert isinstance(info.value.__cause__, ValueError) and "Overflow" in str(info.value.__cause__)
    kept, lost = info.value.outputs
    assert lost is None and list(kept.outputs[0].token_ids) == hf_greedy[0][:8]
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert tokens(llm.generate(PROMPTS[:1], good, use_tqdm=False)) == [hf_greedy[0][:8]]


def test_abort_frees_blocks_at_once(llm):
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[2] * 3, GREEDY)
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.pool.num_blocks
    engine.abort_request("a")
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    final = engine.step()
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_unknown_model_and_unsupported_settings(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        LLM("no-such-model-anywhere")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2)


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "Hello world"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok(expected, add_special_tokens=False)["input_ids"]


def test_kv_slot_utilisation_physical_and_per_sequence(tiny_model_dir):
    """Two requests sharing two full prompt blocks: physically those blocks count once, per
    sequence they count for each request; both figures are exact after the prefill."""
    llm = make_llm(tiny_model_dir)
    engine, bs = llm.llm_engine, llm.llm_engine.block_size
    shared = list(range(5, 5 + 2 * bs))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", shared + [1, 2, 3], params)
    engine.step()  # a's prefill registers the two shared blocks
    engine.add_request("b", shared + [4, 5, 6, 7, 8], params)
    engine.step()  # a decodes, b hits the shared blocks and prefills its 5 own tokens
    s = engine.get_stats()
    a, b = (engine.requests[r].seqs[0] for r in ("a", "b"))
    assert (a.num_computed_tokens, b.num_computed_tokens) == (2 * bs + 4, 2 * bs + 5)
    assert s.kv_seq_tokens == 4 * bs + 9 and s.kv_seq_slots == 6 * bs
    assert s.kv_seq_slot_utilization == (4 * bs + 9) / (6 * bs)
    assert s.kv_slots_allocated == 4 * bs  # 2 shared + 1 own each
    assert s.kv_slot_utilization == (2 * bs + 9) / (4 * bs)
    engine.abort_request(["a", "b"])

"""Speculative decoding in the engine, against the same engine without it (tiny random Llama,
fp32): greedy and seeded sampling give the same tokens, logprobs and finishes whatever the
drafts; rejected drafts leave no block behind; preemption, chunked prefill, prefix caching,
n > 1, LoRA and structured outputs keep working. An oracle proposer (drafts from the reference
output, with planted errors) makes every acceptance path run; ngram runs on its own too."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from conftest import make_llm
from lora_checks import adapters, lora_base  # noqa: F401 - fixtures

from kvserve import SamplingParams
from kvserve.engine.spec_decode.proposer import Proposer, SpecRequestView

PROMPTS = ["the cat sat on the mat and the cat sat on the", "hello world, hello world,",
           "a b c d e f g", "one two three four"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}


class Oracle(Proposer):
    """Drafts the reference continuation of each stream, with every `wrong`-th draft changed:
    accepted runs of every length, rejections at every position."""

    method = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong: int = 3) -> None:
        self.reference, self.wrong, self.calls = reference, wrong, 0

    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        out = []
        for r in requests:
            self.calls += 1
            tokens = r.token_ids.tolist()
            full = self.reference.get(tuple(tokens[: r.num_prompt_tokens]), [])
            draft = list(full[len(tokens):len(tokens) + num_tokens])
            if draft and self.calls % self.wrong == 0:
                k = self.calls % len(draft)
                draft[k] = (draft[k] + 1) % 300
            out.append(draft)
        return out


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return make_llm(tiny_model_dir)


def spec_llm(path, config=None, **kw):
    return make_llm(path, speculative_config=dict(config or NGRAM), **kw)


def with_oracle(llm, base_llm, prompts, params, wrong=3):
    """Point the spec engine's proposer at the base engine's outputs for these prompts."""
    ref = {}
    for out in base_llm.generate(prompts, params, use_tqdm=False):
        for c in out.outputs:
            ref[tuple(out.prompt_token_ids)] = list(out.prompt_token_ids) + list(c.token_ids)
    llm.llm_engine.core.spec.proposer = Oracle(ref, wrong)
    return llm


def same(a, b):
    for x, y in zip(a, b, strict=True):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
        assert [c.finish_reason for c in x.outputs] == [c.finish_reason for c in y.outputs]
        assert [c.stop_reason for c in x.outputs] == [c.stop_reason for c in y.outputs]


def counters(llm):
    s = llm.llm_engine.get_stats()
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens, s.spec_decode_accepted_per_pos)


def assert_no_blocks_held(llm):
    core = llm.llm_engine.core
    assert not core.scheduler.has_unfinished()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


def test_greedy_with_oracle_drafts_equals_plain_decoding(tiny_model_dir, base):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = with_oracle(spec_llm(tiny_model_dir), base, PROMPTS, params)
    same(base.generate(PROMPTS, params, use_tqdm=False),
         llm.generate(PROMPTS, params, use_tqdm=False))
    drafts, drafted, accepted, per_pos = counters(llm)
    assert drafts > 0 and 0 < accepted < drafted  # both kept and rejected drafts
    assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0
    assert_no_blocks_held(llm)


def test_ngram_greedy_equals_plain_decoding(tiny_model_dir, base):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = spec_llm(tiny_model_dir)
    same(base.generate(PROMPTS, params, use_tqdm=False),
         llm.generate(PROMPTS, params, use_tqdm=False))
    assert counters(llm)[1] > 0
    assert_no_blocks_held(llm)


def test_seeded_sampling_logprobs_and_n_equal_plain_decoding(tiny_model_dir, base):
    """A seeded row draws each position with the uniform plain decoding uses there, so
    speculative sampling gives the very same samples; logprobs are the target's."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, n=2,
                            logprobs=2, ignore_eos=True, presence_penalty=0.3)
    llm = with_oracle(spec_llm(tiny_model_dir), base, PROMPTS[:2], params, wrong=4)
    a = base.generate(PROMPTS[:2], params, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    same(a, b)
    for x, y in zip(a, b):
        for c, d in zip(x.outputs, y.outputs):
            assert len(c.logprobs) == len(d.logprobs)
            for e, f in zip(c.logprobs, d.logprobs):
                assert e.keys() == f.keys()
                for t in e:
                    assert math.isclose(e[t].logprob, f[t].logprob, abs_tol=1e-4)
                    assert e[t].rank == f[t].rank
    assert counters(llm)[2] > 0
    assert_no_blocks_held(llm)


def test_stop_inside_an_accepted_run(tiny_model_dir, base):
    """A stop string, a stop token and max_tokens that fall inside a run of accepted drafts
    end the output where plain decoding ends it."""
    free = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)
    for i, out in enumerate(free):
        c = out.outputs[0]
        cases = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                stop=[c.text[len(c.text) // 2:][:3]]),
                 SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                stop_token_ids=[c.token_ids[13]]),
                 SamplingParams(temperature=0, max_tokens=11 + i, ignore_eos=True)]
        for params in cases:
            llm = with_oracle(spec_llm(tiny_model_dir), base, [PROMPTS[i]], params, wrong=1000)
            same(base.generate([PROMPTS[i]], params, use_tqdm=False),
                 llm.generate([PROMPTS[i]], params, use_tqdm=False))
            assert counters(llm)[2] > 0
            assert_no_blocks_held(llm)


def test_blocks_follow_the_kept_tokens_every_step(tiny_model_dir, base):
    """After every step each running seq holds exactly the blocks of its computed tokens:
    the slots of rejected drafts were given back (no leak, none kept for nothing)."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = with_oracle(spec_llm(tiny_model_dir, block_size=8), base, PROMPTS, params, wrong=2)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    core, steps = engine.core, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for seq in core.scheduler.running:
            assert len(core.kv.block_ids(seq)) == -(-seq.num_computed_tokens // 8)
    drafts, drafted, accepted, _ = counters(llm)
    assert accepted < drafted and steps < 60
    assert_no_blocks_held(llm)


def test_preemption_and_chunked_prefill(tiny_model_dir, base):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS] * 2
    small = dict(kv_cache_memory=None, num_gpu_blocks_override=24, block_size=8,
                 max_num_batched_tokens=24, max_num_seqs=8)
    llm = with_oracle(spec_llm(tiny_model_dir, **small), base, prompts, params)
    ref = base.generate(prompts, params, use_tqdm=False)
    same(ref, llm.generate(prompts, params, use_tqdm=False))
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert counters(llm)[2] > 0
    assert_no_blocks_held(llm)


def test_prefix_cache_hits_with_drafts(tiny_model_dir, base):
    """Blocks filled by accepted drafts are cached under the right hashes: a second run of
    the prompts extended by their outputs hits them and decodes the same."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = with_oracle(spec_llm(tiny_model_dir, block_size=8), base, PROMPTS, params)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    longer = [p + o.outputs[0].text for p, o in zip(PROMPTS, first)]
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    with_oracle(llm, base, longer, params)
    same(base.generate(longer, params, use_tqdm=False),
         llm.generate(longer, params, use_tqdm=False))
    assert llm.llm_engine.get_stats().prefix_cache_hits - hits >= 8 * len(PROMPTS)


def test_structured_output_request_beside_a_plain_one(tiny_model_dir, base):
    """A guided and a plain request drafted in the same steps (the guided ones alone, both
    backends: tests/integration/test_spec_decode_structured.py)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    from kvserve.engine.sample.sampling_params import StructuredOutputsParams

    guided = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = with_oracle(spec_llm(tiny_model_dir), base, PROMPTS[:2], [plain, guided])
    a = base.generate(PROMPTS[:2], [plain, guided], use_tqdm=False)
    b = llm.generate(PROMPTS[:2], [plain, guided], use_tqdm=False)
    same(a, b)
    assert b[1].outputs[0].text.startswith('{"a"')  # the grammar held (max_tokens cuts it)
    assert counters(llm)[2] > 0


def test_disable_by_batch_size(tiny_model_dir):
    """Above disable_by_batch_size running requests a step drafts nothing; at or below, it
    drafts."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = spec_llm(tiny_model_dir, dict(NGRAM, disable_by_batch_size=2))
    llm.generate(PROMPTS, params, use_tqdm=False)  # 4 running together, to the end
    assert counters(llm)[0] == 0
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert counters(llm)[0] > 0


def test_an_offline_batch_tail_is_measured_apart_from_serving(tiny_model_dir):
    """`LLM.generate` drains its own requests: the drafting/plain chooser books those steps
    as an offline tail (judged by the slowest request), and the same engine stepped as a
    server steps it (requests added, no LLM call around them) books serving epochs."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = spec_llm(tiny_model_dir, dict(NGRAM, adaptive=True))
    core = llm.llm_engine.core
    mode = core.spec.adaptive.mode
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert mode.drain_rates and not mode.rates and not core.arrivals_closed
    booked = {key: r[2] for key, r in mode.drain_rates.items()}
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"served-{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert mode.rates and {key: r[2] for key, r in mode.drain_rates.items()} == booked
    assert_no_blocks_held(llm)


def test_lora_requests_with_drafts(lora_base, adapters):
    from kvserve.lora.request import LoRARequest

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    base_llm = make_llm(lora_base, **lora)
    llm = spec_llm(lora_base, **lora)
    reqs = [None, LoRARequest("a0", 1, str(adapters[0]))]
    ref = base_llm.generate(PROMPTS[:2], params, lora_request=reqs, use_tqdm=False)
    full = {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            for o in ref}
    llm.llm_engine.core.spec.proposer = Oracle(full, wrong=3)
    same(ref, llm.generate(PROMPTS[:2], params, lora_request=reqs, use_tqdm=False))
    assert 0 < counters(llm)[2] < counters(llm)[1]

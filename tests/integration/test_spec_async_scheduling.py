"""Async scheduling with speculative decoding (engine/async_scheduling.py, host-side proposers):
a step without drafts lets the next one launch ahead when the proposer, asked over the known
tokens, drafts for nobody; a verification step runs in turn. Forced on a CPU engine (tiny random
Llama, fp32), the outputs must be those of plain decoding and of synchronous speculation, with
every block back, under finishes inside an accepted run, stops, chunking and preemption."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.engine.errors import ConfigError
from kvserve.engine.spec_decode.proposer import Proposer, SpecRequestView

PROMPTS = ["the cat sat on the mat and the cat sat on the", "hello world, hello world,",
           "a b c d e f g", "one two three four", "x y x y x y x y"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}


class Sparse(Proposer):
    """Drafts the reference continuation (every `wrong`-th draft changed) only at positions
    where the known length is a multiple of `every`: runs of steps without drafts (launched
    ahead) between verification steps (run in turn), accepted runs of every length."""

    method = "sparse"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], every: int = 4,
                 wrong: int = 3) -> None:
        self.reference, self.every, self.wrong = reference, every, wrong
        self.calls = self.asked = 0

    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        out = []
        self.asked += 1
        for r in requests:
            tokens = r.token_ids.tolist()
            if len(tokens) % self.every:
                out.append([])
                continue
            self.calls += 1
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


def _engine(path, config, asynchronous, **kw):
    llm = make_llm(path, speculative_config=dict(config), async_scheduling=asynchronous, **kw)
    assert llm.llm_engine.async_scheduling is asynchronous
    return llm


def _sparse(llm, base_llm, prompts, params, every=4):
    ref = {}
    for out in base_llm.generate(prompts, params, use_tqdm=False):
        ref[tuple(out.prompt_token_ids)] = list(out.prompt_token_ids) + list(
            out.outputs[0].token_ids)
    llm.llm_engine.core.spec.proposer = Sparse(ref, every)
    return llm


def _same(got, want) -> None:
    """Tokens, text and finishes exactly; the logprobs' ids exactly and their values to fp32
    noise (a verification scores a position in a batch of another shape)."""
    for x, y in zip(got, want, strict=True):
        for c, d in zip(x.outputs, y.outputs, strict=True):
            assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == \
                (d.token_ids, d.text, d.finish_reason, d.stop_reason)
            assert (c.logprobs is None) == (d.logprobs is None)
            for e, f in zip(c.logprobs or [], d.logprobs or [], strict=True):
                assert e.keys() == f.keys()
                assert all(abs(e[t].logprob - f[t].logprob) < 1e-4 for t in e)


def _overlapped(llm) -> int:
    return llm.llm_engine._stepper.overlapped_steps


def _drafted(llm) -> int:
    return llm.llm_engine.get_stats().spec_decode_num_draft_tokens


def _all_blocks_back(llm) -> None:
    core = llm.llm_engine.core
    assert not core.scheduler.has_unfinished() and core.stepper.inflight is None
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_host_proposers_equal_plain_and_synchronous_speculation(tiny_model_dir, base, config):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    sync = _engine(tiny_model_dir, config, False)
    fast = _engine(tiny_model_dir, config, True)
    _same(sync.generate(PROMPTS, params, use_tqdm=False), want)
    _same(fast.generate(PROMPTS, params, use_tqdm=False), want)
    assert _drafted(fast) > 0
    _all_blocks_back(fast)


def test_steps_without_drafts_launch_ahead_and_verifications_run_in_turn(tiny_model_dir, base):
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, logprobs=2)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    fast = _sparse(_engine(tiny_model_dir, NGRAM, True), base, PROMPTS, params)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    _same(got, want)
    counters = fast.llm_engine.get_stats()
    assert 0 < counters.spec_decode_num_accepted_tokens < counters.spec_decode_num_draft_tokens
    assert _overlapped(fast) > 0  # the steps between drafts overlapped
    _all_blocks_back(fast)


def test_a_proposer_that_always_drafts_runs_in_turn(tiny_model_dir, base):
    """Every step would draft: nothing launches ahead (each step's drafts need its
    predecessor's tokens), and the outputs are still the plain ones."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = base.generate(PROMPTS[:2], params, use_tqdm=False)
    fast = _sparse(_engine(tiny_model_dir, NGRAM, True), base, PROMPTS[:2], params, every=1)
    _same(fast.generate(PROMPTS[:2], params, use_tqdm=False), want)
    assert _overlapped(fast) == 0
    _all_blocks_back(fast)


def test_finishes_inside_an_accepted_run_and_stops(tiny_model_dir, base):
    """max_tokens, a stop token and a stop string that fall inside accepted drafts, and EOS:
    the same tokens, text and reasons as plain decoding; no block kept."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = base.generate(PROMPTS, greedy, use_tqdm=False)
    stop_tok = ref[0].outputs[0].token_ids[9]
    text = ref[3].outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             stop=[text[len(text) // 2:len(text) // 2 + 3]]),
              SamplingParams(temperature=0, max_tokens=11)]
    want = base.generate(PROMPTS, params, use_tqdm=False)
    for every in (2, 3):
        fast = _sparse(_engine(tiny_model_dir, NGRAM, True), base, PROMPTS, greedy, every)
        _same(fast.generate(PROMPTS, params, use_tqdm=False), want)
        assert _overlapped(fast) > 0
        _all_blocks_back(fast)
    assert {o.outputs[0].finish_reason for o in want} >= {"length", "stop"}


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=24),  # chunked prefill beside decode and verification rows
    dict(kv_cache_memory=1 << 17),  # a pool so small that steps preempt
], ids=["chunked", "preempting"])
def test_under_chunking_and_block_pressure(tiny_model_dir, base, kw):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    want = make_llm(tiny_model_dir, **kw).generate(PROMPTS, params, use_tqdm=False)
    fast = _sparse(_engine(tiny_model_dir, NGRAM, True, **kw), base, PROMPTS, params, every=3)
    _same(fast.generate(PROMPTS, params, use_tqdm=False), want)
    assert _overlapped(fast) > 0 and _drafted(fast) > 0
    if "kv_cache_memory" in kw:
        assert fast.llm_engine.get_stats().num_preemptions > 0
    _all_blocks_back(fast)


def test_disable_by_batch_size_lets_every_step_overlap(tiny_model_dir, base):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = base.generate(PROMPTS, params, use_tqdm=False)
    fast = _engine(tiny_model_dir, dict(NGRAM, disable_by_batch_size=2), True)
    _same(fast.generate(PROMPTS, params, use_tqdm=False), want)
    assert _overlapped(fast) >= 10
    _all_blocks_back(fast)


def test_model_proposers_refuse_async_scheduling():
    from kvserve.engine.config import EngineConfig

    EngineConfig(speculative_config=dict(NGRAM), async_scheduling=True)  # accepted
    with pytest.raises(ConfigError, match="host-side proposers"):
        EngineConfig(speculative_config={"method": "draft_model", "model": "m",
                                         "num_speculative_tokens": 2}, async_scheduling=True)


def test_seeded_sampling_equals_plain_decoding(tiny_model_dir, base):
    """A seeded row draws each position with the uniform plain decoding uses there, whether
    the step was launched ahead or verified drafts: the very same samples and logprobs."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=11 + i, max_tokens=24,
                             logprobs=1, ignore_eos=True) for i in range(len(PROMPTS))]
    want = base.generate(PROMPTS, params, use_tqdm=False)
    fast = _sparse(_engine(tiny_model_dir, NGRAM, True), base, PROMPTS, params, every=3)
    _same(fast.generate(PROMPTS, params, use_tqdm=False), want)
    counters = fast.llm_engine.get_stats()
    assert counters.spec_decode_num_accepted_tokens > 0 and _overlapped(fast) > 0
    _all_blocks_back(fast)


def test_look_ahead_counts_idle_steps_but_leaves_the_try_to_the_drafting_step():
    """A request whose drafts are not worth it tries one token every PROBE_EVERY steps; the
    look-ahead question (steps launched without drafts) counts those steps, and the try it
    announces is still there when the step that drafts asks."""
    from kvserve.engine.spec_decode.adaptive import PROBE_EVERY, AdaptiveDrafts

    drafts = AdaptiveDrafts(3)
    drafts.observe("r", 3, 0)  # nothing accepted: alpha falls
    never = 2.0  # a threshold no acceptance reaches
    asked = [drafts.num_tokens("r", never, look_ahead=True) for _ in range(PROBE_EVERY)]
    assert asked == [0] * (PROBE_EVERY - 1) + [1]
    assert drafts.num_tokens("r", never, look_ahead=True) == 1  # still due
    assert drafts.num_tokens("r", never) == 1  # the drafting step takes it
    assert drafts.num_tokens("r", never) == 0

"""Request options beyond plain sampling on the tiny random Llama: logit_bias, best_of and the
priority scheduling policy."""

from __future__ import annotations

import pytest
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.engine.errors import InvalidRequestError

PROMPTS = ["Hello world", "The quick brown fox", "What is the capital of France?",
           "0123456789 abcdefghijklmnopqrstuvwxyz"]
PLAIN = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_logit_bias_bans_and_forces_tokens(llm):
    plain = llm.generate("Hello world", PLAIN, use_tqdm=False)[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            logit_bias={t: -100 for t in set(plain)})
    assert not set(plain) & set(
        llm.generate("Hello world", banned, use_tqdm=False)[0].outputs[0].token_ids)
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                            logit_bias={42: 100}, logprobs=1)
    out = llm.generate("Hello world", forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42] * 6
    # logprobs are of the model's own distribution, before the bias (as vLLM's)
    assert all(entry[42].logprob < -0.01 for entry in out.logprobs)
    with pytest.raises(InvalidRequestError, match="past the vocabulary"):
        llm.llm_engine.add_request("b", "x", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 200})


def test_best_of_returns_the_most_likely_candidates(llm):
    seeded = dict(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    every = llm.generate("Hello world", SamplingParams(n=4, logprobs=0, **seeded),
                         use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda o: o.cumulative_logprob, reverse=True)
    best = llm.generate("Hello world", SamplingParams(n=2, best_of=4, logprobs=0, **seeded),
                        use_tqdm=False)[0].outputs
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1]
    plain = llm.generate("Hello world", SamplingParams(n=1, best_of=4, **seeded),
                         use_tqdm=False)[0].outputs
    assert len(plain) == 1 and plain[0].logprobs is None  # ranked, but not asked for
    assert plain[0].token_ids == ranked[0].token_ids
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_priority_policy_serves_lower_values_first(tiny_model_dir, llm):
    one_at_a_time = make_llm(tiny_model_dir, max_num_seqs=1, scheduling_policy="priority")
    engine = one_at_a_time.llm_engine
    for rid, prio in [("late", 5), ("urgent", 0), ("middle", 3)]:
        engine.add_request(rid, "Hello world", PLAIN, priority=prio)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "middle", "late"]
    outs = one_at_a_time.generate(PROMPTS[:2], PLAIN, priority=[1, 0], use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS[:2]  # still in input order
    with pytest.raises(InvalidRequestError, match="scheduling-policy priority") as info:
        llm.llm_engine.add_request("p", "x", PLAIN, priority=2)  # the default fcfs engine
    assert info.value.param == "priority"


def test_priority_preempts_the_least_urgent(tiny_model_dir):
    from collections import deque

    from kvserve.engine.core.scheduling_policy import add_waiting, victim
    from kvserve.engine.core.sequence import Sequence

    seqs = [Sequence(i, str(i), 0, [1], PLAIN, arrival_time=float(i), priority=p)
            for i, p in enumerate([2, 0, 2, 1])]
    waiting: deque = deque()
    for s in seqs:
        add_waiting(waiting, s, "priority")
    assert [s.seq_id for s in waiting] == [1, 3, 0, 2]
    assert victim(seqs, "priority").seq_id == 2  # highest value, newest among equals
    assert victim(seqs, "fcfs").seq_id == 3
    small = make_llm(tiny_model_dir, num_gpu_blocks_override=6, scheduling_policy="priority",
                     enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outs = small.generate(PROMPTS, params, priority=[3, 0, 1, 2], use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions > 0
    alone = [small.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == alone  # preemption changed nothing

"""Continuations on the tiny fp32 Llama: a request given the first k output tokens of a run goes
on exactly as that run did (greedy and seeded), counts them toward max_tokens and min_tokens,
stops on a stop string that straddles the break, advances its grammar over them, and shows only
what follows them."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.engine.engine_core.client_outputs import ClientOutputProcessor
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sample.continuation import Continuation
from kvserve.engine.structured_output.params import StructuredOutputsParams

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_llm(tiny_model_dir, max_model_len=128).llm_engine


def run(engine, params, continuation=None, prompt=PROMPT) -> list[RequestOutput]:
    """Every output of one request, step by step, to its finish."""
    rid = f"c{next(_ids)}"
    engine.add_request(rid, prompt, params, continuation=continuation)
    outs: list[RequestOutput] = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def text_after(outs: list[RequestOutput], k: int, index: int = 0) -> str:
    """The text an uninterrupted run had shown once its choice `index` had k tokens."""
    text = ""
    for o in outs:
        c = next(c for c in o.outputs if c.index == index)
        if len(c.token_ids) <= k:
            text = c.text
    return text


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_continuation_goes_on_as_the_uninterrupted_run(engine, params):
    full = run(engine, params)
    final = full[-1].outputs[0]
    assert len(final.token_ids) == 24
    for k in (1, 7, 16):
        rest = run(engine, params, Continuation(tuple(final.token_ids[:k])))[-1]
        c = rest.outputs[0]
        assert c.token_ids == final.token_ids[k:]
        assert text_after(full, k) + c.text == final.text
        assert c.finish_reason == "length" and c.index == 0
        assert rest.prompt_token_ids == full[-1].prompt_token_ids


def test_the_first_new_text_is_what_the_run_showed_next(engine):
    """Incremental detokenisation is primed with the continuation: each new output's text
    grows as the uninterrupted run's did after the same tokens."""
    full = run(engine, GREEDY)
    k = 9
    cont = Continuation(tuple(full[-1].outputs[0].token_ids[:k]))
    base = text_after(full, k)
    for out in run(engine, GREEDY, cont):
        c = out.outputs[0]
        assert base + c.text == text_after(full, k + len(c.token_ids))


def test_n_greater_than_one_continues_one_choice_by_its_index(engine):
    both = run(engine, dataclasses.replace(SEEDED, n=2))[-1]
    second = next(c for c in both.outputs if c.index == 1)
    rest = run(engine, SEEDED, Continuation(tuple(second.token_ids[:5]), index=1))[-1]
    assert rest.outputs[0].index == 1
    assert rest.outputs[0].token_ids == second.token_ids[5:]
    with pytest.raises(InvalidRequestError, match="n = 1"):
        run(engine, dataclasses.replace(SEEDED, n=2), Continuation((1, 2), index=0))


def test_continuation_tokens_count_toward_max_tokens(engine):
    final = run(engine, GREEDY)[-1].outputs[0]
    rest = run(engine, dataclasses.replace(GREEDY, max_tokens=10),
               Continuation(tuple(final.token_ids[:6])))[-1].outputs[0]
    assert rest.token_ids == final.token_ids[6:10] and rest.finish_reason == "length"
    # already at max_tokens: finished at once, nothing new
    done = run(engine, dataclasses.replace(GREEDY, max_tokens=6),
               Continuation(tuple(final.token_ids[:6])))
    assert len(done) == 1 and done[0].finished
    assert done[0].outputs[0].token_ids == [] and done[0].outputs[0].text == ""
    assert done[0].outputs[0].finish_reason == "length"


def test_continuation_tokens_count_toward_min_tokens(engine):
    """EOS made overwhelmingly likely: the run ends right after min_tokens; a continuation of
    its first 8 tokens ends at the same length, so those 8 counted."""
    eos = engine.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=10,
                            logit_bias={eos: 100.0})
    final = run(engine, params)[-1].outputs[0]
    assert len(final.token_ids) == 11 and final.token_ids[-1] == eos
    rest = run(engine, params, Continuation(tuple(final.token_ids[:8])))[-1].outputs[0]
    assert rest.token_ids == final.token_ids[8:] and rest.finish_reason == "stop"


def test_a_stop_string_straddling_the_break_stops(engine):
    full = run(engine, GREEDY)
    final = full[-1].outputs[0]
    k = next(k for k in range(4, 20)
             if 2 <= len(text_after(full, k)) and len(text_after(full, k)) + 3 <= len(final.text)
             and final.text.find(final.text[len(text_after(full, k)) - 2:
                                            len(text_after(full, k)) + 3])
             == len(text_after(full, k)) - 2)
    at = len(text_after(full, k))
    stop = final.text[at - 2:at + 3]
    params = dataclasses.replace(GREEDY, stop=[stop])
    whole = run(engine, params)[-1].outputs[0]
    assert whole.finish_reason == "stop" and whole.text == final.text[:at - 2]
    rest = run(engine, params, Continuation(tuple(final.token_ids[:k])))[-1].outputs[0]
    assert rest.finish_reason == "stop" and rest.stop_reason == stop
    assert k + len(rest.token_ids) == len(whole.token_ids)  # stopped on the same token
    assert rest.text == ""  # the stop string began in text the client already has


def test_the_grammar_is_advanced_over_the_continuation(engine):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(regex="(ab|cd)+x")))
    final = run(engine, params)[-1].outputs[0]
    assert final.finish_reason == "stop" and len(final.token_ids) > 3
    rest = run(engine, params, Continuation(tuple(final.token_ids[:2])))[-1].outputs[0]
    assert rest.token_ids == final.token_ids[2:]
    outside = engine.tokenizer.encode("zzz", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="structured output"):
        run(engine, params, Continuation(tuple(outside)))


def test_the_client_side_text_of_a_core_process_continues_too(engine):
    """The core process's client (engine_core/client_outputs.py) primes its own detokeniser:
    fed the core's deltas of the new tokens, it shows the uninterrupted run's remaining text."""
    full = run(engine, GREEDY)
    final = full[-1].outputs[0]
    prompt_ids = full[-1].prompt_token_ids
    k = 5
    client = ClientOutputProcessor(engine.tokenizer)
    client.add("r", PROMPT, GREEDY, continuation=Continuation(tuple(final.token_ids[:k])))
    new = final.token_ids[k:]
    outs = []
    for i, tok in enumerate(new):
        last = i == len(new) - 1
        delta = ("r", last, 0, None, [(0, [tok], None, None, "length" if last else None, None)],
                 None, prompt_ids if i == 0 else None, None, None)
        outs += client.process([delta])[0]
    assert outs[-1].outputs[0].token_ids == new
    assert text_after(full, k) + outs[-1].outputs[0].text == final.text


def test_a_core_process_continues_as_the_engine_here(engine, tiny_model_dir):
    """The same continuations through an engine core process (its client makes the text):
    seeded and already at max_tokens."""
    from kvserve.engine.engine_core import MULTIPROCESSING_ENV

    mp = pytest.MonkeyPatch()
    mp.setenv(MULTIPROCESSING_ENV, "1")
    remote = make_llm(tiny_model_dir, max_model_len=128)
    mp.undo()
    try:
        final = run(engine, SEEDED)[-1].outputs[0]
        cont = Continuation(tuple(final.token_ids[:6]))
        here = run(engine, SEEDED, cont)[-1].outputs[0]
        there = run(remote.llm_engine, SEEDED, cont)[-1].outputs[0]
        assert (there.token_ids, there.text) == (here.token_ids, here.text)
        assert there.token_ids == final.token_ids[6:]
        short = dataclasses.replace(SEEDED, max_tokens=6)
        done_here = run(engine, short, cont)[-1].outputs[0]
        done_there = run(remote.llm_engine, short, cont)[-1].outputs[0]
        assert done_there.token_ids == [] and done_there.finish_reason == "length"
        assert done_there.text == done_here.text
    finally:
        remote.shutdown()


def test_the_prefix_cache_serves_prompt_and_continuation(engine):
    """A continuation's lookup covers prompt + continuation: after the uninterrupted run, the
    blocks of its prompt and first 30 output tokens are found (the last token is computed)."""
    params = dataclasses.replace(GREEDY, max_tokens=40)
    final = run(engine, params)[-1].outputs[0]
    prompt_len = len(engine.tokenizer(PROMPT)["input_ids"])
    before = engine.get_stats().prefix_cache_hits
    rest = run(engine, params, Continuation(tuple(final.token_ids[:30])))[-1]
    hits = engine.get_stats().prefix_cache_hits - before
    block = engine.block_size
    assert hits == (prompt_len + 30 - 1) // block * block > prompt_len
    assert rest.outputs[0].token_ids == final.token_ids[30:]
    assert rest.num_cached_tokens <= prompt_len  # usage's cached tokens are prompt tokens

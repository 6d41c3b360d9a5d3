"""Async scheduling (engine/async_scheduling.py) forced on a CPU engine: step N+1 is scheduled
and launched before step N's tokens are read, its decode inputs filled from N's sampled ids.
Everything it returns must be what the synchronous engine returns: tokens, logprobs, text,
finish reasons, under EOS and stop strings, chunked prefill, a small pool, aborts and requests
that cannot overlap."""

from __future__ import annotations

import pytest
from conftest import make_llm
from test_llm_engine import PROMPTS

from kvserve import SamplingParams
from kvserve.engine.async_scheduling import PLACEHOLDER
from kvserve.engine.errors import ConfigError



def _mixed_params(eos: int) -> list[SamplingParams]:
    """Lengths that end at different steps, EOS and stop-token stops the host only sees when it
    reads the token, seeded sampling with filters, logprobs, min_tokens."""
    return [
        SamplingParams(temperature=0, max_tokens=5, logprobs=2),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7, max_tokens=12,
                       logprobs=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=30, min_tokens=4),
        SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[eos]),
        SamplingParams(temperature=0.7, seed=11, max_tokens=23, ignore_eos=True),
    ]


def _stop_on_early_token(llm) -> SamplingParams:
    """Greedy params that stop on the token the first prompt's greedy run makes third: a stop
    the engine only knows once it has read that token, with a step for the seq in flight."""
    first = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6,
                                                    ignore_eos=True), use_tqdm=False)
    return SamplingParams(temperature=0, max_tokens=20,
                          stop_token_ids=[first[0].outputs[0].token_ids[2]])


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in c.logprobs]
              if c.logprobs else None) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    sync = make_llm(tiny_model_dir, async_scheduling=False)
    fast = make_llm(tiny_model_dir, async_scheduling=True)
    assert not sync.llm_engine.async_scheduling and fast.llm_engine.async_scheduling
    return sync, fast


def _overlapped(llm) -> int:
    return llm.llm_engine._stepper.overlapped_steps


def test_mixed_requests_give_the_synchronous_outputs(pair):
    sync, fast = pair
    eos = sync.get_tokenizer().eos_token_id
    params = _mixed_params(eos)
    params[0] = _stop_on_early_token(sync)
    before = _overlapped(fast)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert want[0].outputs[0].finish_reason == "stop"  # stopped while its next step was queued
    assert len(want[0].outputs[0].token_ids) == 3
    # Most decode steps launched ahead: 29 of them follow the prefill (the longest request).
    assert _overlapped(fast) - before >= 20
    assert _overlapped(sync) == 0


def test_stop_strings_and_text(pair):
    sync, fast = pair
    first = sync.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    text = first[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert want[3].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=24),  # chunked prefill beside decode rows
    dict(kv_cache_memory=1 << 17),  # a pool so small that the synchronous steps preempt
])
def test_under_chunking_and_block_pressure(tiny_model_dir, kw):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    sync = make_llm(tiny_model_dir, async_scheduling=False, **kw)
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    fast = make_llm(tiny_model_dir, async_scheduling=True, **kw)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert _overlapped(fast) > 0
    # Every block came back (the ones a finished seq held while its last step was in flight too)
    total = fast.llm_engine.kv.pool.num_blocks
    assert fast.llm_engine.kv.num_free_blocks == sync.llm_engine.kv.num_free_blocks == total
    assert not fast.llm_engine.requests and fast.llm_engine._stepper.inflight is None


def test_requests_that_cannot_overlap_run_synchronously_beside_others(pair):
    """Penalties read the output tokens, n > 1 forks and prompt logprobs the exact progress:
    while one is in the engine no step launches ahead, and the outputs stay the same."""
    sync, fast = pair
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=6, ignore_eos=True,
                       prompt_logprobs=1),
    ]
    want = sync.generate(PROMPTS, params, use_tqdm=False)
    got = fast.generate(PROMPTS, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]


def test_prefix_cache_holds_the_real_tokens(pair):
    """Blocks are registered only once their tokens are read: a prompt that repeats an earlier
    request's prompt and output hits the cache and gives the synchronous engine's tokens."""
    sync, fast = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = fast.generate(PROMPTS[2], params, use_tqdm=False)[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids
    want = sync.generate({"prompt_token_ids": follow}, params, use_tqdm=False)
    got = fast.generate({"prompt_token_ids": follow}, params, use_tqdm=False)
    assert got[0].num_cached_tokens >= 48  # three full blocks of the earlier run, at least
    assert _summary(got) == _summary(want)


def test_abort_while_a_step_is_in_flight(pair):
    """Stepping the engine by hand: a request aborted while its next token is on the device
    ends with the tokens read so far (no placeholder), frees its blocks, and the others go on."""
    _, fast = pair
    engine = fast.llm_engine
    free = engine.kv.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"a{i}", p, params)
    seen: dict[str, list[int]] = {}
    aborted = None
    for _ in range(200):
        for out in engine.step():
            ids = out.outputs[0].token_ids
            assert PLACEHOLDER not in ids
            assert len(ids) >= len(seen.get(out.request_id, []))  # never shrinks
            seen[out.request_id] = ids
            if out.request_id == "a1" and out.outputs[0].finish_reason == "abort":
                aborted = out
        if len(seen.get("a1", [])) == 4 and aborted is None and "a1" in engine.requests:
            assert engine._stepper.inflight is not None  # its fifth token is in flight
            engine.abort_request("a1")
        if not engine.has_unfinished_requests():
            break
    assert aborted is not None and aborted.outputs[0].token_ids == seen["a1"][:4]
    assert len(seen["a0"]) == len(seen["a2"]) == 12
    assert engine.kv.num_free_blocks == free


def test_async_scheduling_defaults_off_on_a_cpu(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    assert llm.llm_engine.async_scheduling is False


def test_async_scheduling_with_tensor_parallelism_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="async scheduling"):
        make_llm(tiny_model_dir, async_scheduling=True, tensor_parallel_size=2)


def test_cli_flag_reaches_the_engine_config():
    from kvserve.service.cli import build_parser, engine_config_from_args

    for argv, want in (([], None), (["--async-scheduling"], True),
                       (["--no-async-scheduling"], False)):
        args = build_parser().parse_args(["serve", "m", *argv])
        assert engine_config_from_args(args).async_scheduling is want


def test_aborting_every_request_in_flight_leaves_no_step_behind(pair):
    """All requests aborted while a step is in flight: the next call hands out their abort
    outputs and drops that step, so an idle engine holds nothing, and later requests give the
    synchronous engine's tokens."""
    sync, fast = pair
    engine = fast.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"b{i}", p, params)
    while engine._stepper.inflight is None or engine._stepper.overlapped_steps == 0:
        engine.step()
    assert engine._stepper.inflight is not None
    engine.abort_request(["b0", "b1"])
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["b0", "b1"]
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert all(PLACEHOLDER not in o.outputs[0].token_ids for o in outs)
    assert engine._stepper.inflight is None and not engine.has_unfinished_requests()
    want = sync.generate(PROMPTS[:3], params, use_tqdm=False)
    assert _summary(fast.generate(PROMPTS[:3], params, use_tqdm=False)) == _summary(want)

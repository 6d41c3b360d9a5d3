"""EngineCore on the tiny random Llama, without the front: it takes processed requests, its step
is schedule -> execute -> update (driving the three by hand gives step()'s tokens), it returns
the requests that moved, never text of its own, and an abort frees the blocks at once."""

from __future__ import annotations

import pytest
from kvserve.engine.config import EngineConfig
from kvserve.engine.core.engine_core import EngineCore
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.processor import Processor
from kvserve.engine.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 13, 21, 34, 55, 89, 144, 233, 3, 7, 11]


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    return EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu",
                                   kv_cache_memory=1 << 22, async_scheduling=False))


def no_text_processor(core: EngineCore) -> Processor:
    """A processor whose requests carry no text tracker: the core must step them all the same."""
    return Processor(core, OutputProcessor(core.tokenizer).new_text)


def add(core: EngineCore, rid: str, params: SamplingParams = GREEDY) -> None:
    core.add_request(no_text_processor(core).process(rid, PROMPT, params, detokenize=False))


def run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.requests or core.pending:
        for state in core.step():
            tokens[state.request_id] = list(state.seqs[0].output_token_ids)
    return tokens


def test_step_returns_the_requests_that_moved_until_they_finish(core):
    add(core, "a")
    first = core.step()
    assert [s.request_id for s in first] == ["a"] and len(first[0].seqs[0].output_token_ids) == 1
    rest = run(core)
    seq = first[0].seqs[0]
    assert len(rest["a"]) == 6 and seq.finish_reason == "length"
    assert first[0].detoks[0].text == ""  # no text tracker: the core made no text of its own
    assert not core.requests and core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_schedule_execute_update_by_hand_gives_the_steps_tokens(core):
    add(core, "stepped")
    stepped = run(core)["stepped"]
    add(core, "by-hand")
    while core.requests:
        sched = core.schedule()
        assert sched is not None
        launched = core.execute_model(sched)
        tokens = launched.result.sampled_token_ids.tolist()
        moved = core.update_from_output(sched, launched, tokens, [None] * len(tokens), None)
        assert [s.request_id for s in moved] == ["by-hand"]
    assert list(moved[0].seqs[0].output_token_ids) == stepped


def test_abort_frees_blocks_now_and_the_next_step_returns_it(core):
    add(core, "gone", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    core.step()
    assert core.kv.num_free_blocks < core.kv.pool.num_blocks
    core.abort_requests(["gone", "never-added"])
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks and not core.requests
    (state,) = core.step()
    assert state.request_id == "gone" and state.seqs[0].finish_reason == "abort"
    assert core.step() == []


def test_a_request_that_fails_alone_is_aborted_and_reported(core):
    add(core, "ok")
    add(core, "bad")
    core.requests["bad"].detoks[0].update = _raise  # its text fails: that request only
    moved = core.step()
    assert [s.request_id for s in moved] == ["ok"]
    assert isinstance(core.errors.pop("bad"), ValueError) and "bad" not in core.requests
    assert run(core)["ok"] and core.kv.num_free_blocks == core.kv.pool.num_blocks


def _raise(ids: list[int]) -> None:
    raise ValueError("a text tracker that fails")

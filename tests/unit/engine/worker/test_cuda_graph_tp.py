"""Decode graphs in a tensor-parallel engine (2 ranks over gloo, the real Triton decode kernel
in the interpreter, the stand-in capture on every rank): the same greedy tokens and logprobs
as the same engine before it captured, every decode step replayed on every rank; a capture
that fails on one rank leaves every rank eager, with the same output."""

from __future__ import annotations

import logging

import pytest

from conftest import make_llm
from forked_workers import forked_workers
from graph_checks import StandIn, assert_same_outputs, interpreter  # noqa: F401 - fixture
from kvserve import SamplingParams

PROMPTS = ["the cat sat", "a dog ran far away", "hello"]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)
RANKS = 2


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Workers fork from a preloaded fork server (forked_workers.py): no import each. It starts
    with the module's first engine, under `interpreter`'s TRITON_INTERPRET=1."""
    with forked_workers("triton", "kvserve.kernels.triton_attention",
                        "kvserve.kernels.triton_cache"):
        yield


def _engine(tiny_model_dir):
    return make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4,
                    max_model_len=64, tensor_parallel_size=RANKS)


def test_every_rank_replays_and_matches_eager(tiny_model_dir, tmp_path):
    stand_in = StandIn(tmp_path)
    llm = _engine(tiny_model_dir)
    try:
        want = llm.generate(PROMPTS, PARAMS, use_tqdm=False)  # eager: nothing captured yet
        engine = llm.llm_engine
        engine._capture_decode_graphs(stand_in)
        assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [4, 2, 1]
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        counts = stand_in.counts(RANKS)
        # 4 decode steps of 3 rows (each request's first token comes from its prefill)
        assert counts[0] == engine.runner.graphs.replays >= 4
        assert counts == [counts[0]] * RANKS  # every rank replayed every graph step
    finally:
        llm.shutdown()
    assert_same_outputs(got, want)


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_capture_failure_on_one_rank_leaves_every_rank_eager(tiny_model_dir, tmp_path,
                                                               caplog, fail_rank):
    stand_in = StandIn(tmp_path, fail_rank=fail_rank)
    llm = _engine(tiny_model_dir)
    try:
        want = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
            llm.llm_engine._capture_decode_graphs(stand_in)
        assert llm.llm_engine.runner.graphs is None
        assert f"rank {fail_rank}: RuntimeError: injected" in caplog.text
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert stand_in.counts(RANKS) == [0] * RANKS
    finally:
        llm.shutdown()
    assert_same_outputs(got, want)

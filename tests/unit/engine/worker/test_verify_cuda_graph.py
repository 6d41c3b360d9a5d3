"""CUDA graphs for speculative decoding's verification step (engine/worker/cuda_graph.py): a
second ladder of uniform graphs with 1 + k tokens per sequence, steps of uneven draft lengths
padded into them, checked on the CPU with the stand-in capture (a plain call in place of
CUDAGraph replay) over the real Triton kernel in the interpreter, against the eager forward."""

import pytest
import torch

from graph_checks import (TinyAttentionModel, assert_same_outputs,  # noqa: F401
                          interpreter)
from kvserve.engine.spec_decode.proposer import Proposer
from kvserve.engine.worker.cuda_graph import (MAX_CAPTURE, DecodeGraphs, capture_sizes,
                                              pad_to_uniform, uniform_sizes)
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.plan import plan_attention

BS, WIDTH, HEADS, KV_HEADS, D, VOCAB, Q = 4, 5, 4, 2, 16, 50, 4


def TinyModel() -> TinyAttentionModel:  # noqa: N802 - a model class's stand-in
    """The parts of a forward that see the layout, over the Triton attention kernel."""
    return TinyAttentionModel(VOCAB, 24, BS, HEADS, KV_HEADS, D, backend="triton")


def _batch(q_lens: list[int], seed: int = 0):
    """A verification-like batch: each sequence has a computed prefix and q_lens[i] new
    tokens (its last token and its drafts)."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    ql = torch.tensor(q_lens)
    seq_lens = (ql + torch.randint(1, WIDTH * BS - Q, (n,), generator=g)).to(torch.int32)
    tables = torch.stack([torch.randperm(23, generator=g)[:WIDTH] + 1 for _ in range(n)])
    tables = tables.to(torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    torch.cumsum(ql, 0, out=qsl[1:])
    seq_idx = torch.repeat_interleave(torch.arange(n), ql)
    pos = (torch.arange(int(qsl[-1])) - qsl[:-1].long()[seq_idx]
           + (seq_lens.long() - ql)[seq_idx])
    slots = tables[seq_idx, pos // BS].long() * BS + pos % BS
    ids = torch.randint(0, VOCAB, (int(qsl[-1]),), generator=g)
    return ids, pos, slots, tables, seq_lens, qsl


def _eager(model, ids, pos, slots, tables, seq_lens, qsl):
    max_q = int((qsl[1:] - qsl[:-1]).max())
    meta = AttentionMetadata(slots, tables, seq_lens, qsl, max_q, int(seq_lens.max()),
                             backend="triton",
                             plan=plan_attention(tables, seq_lens, qsl, BS, max_q, None))
    return model(ids, pos, meta)


def _graphs(model, captured=None):
    return DecodeGraphs(model, max_num_seqs=8, max_blocks_per_seq=WIDTH, block_size=BS,
                        device=torch.device("cpu"), backend="triton", query_lens=(Q,),
                        capture=lambda fn: (captured.append(fn) if captured is not None
                                            else None) or fn)


def test_verification_ladder_in_tokens():
    assert uniform_sizes(capture_sizes(8), 4) == [8, 4, 2, 1]
    big = uniform_sizes(capture_sizes(512), 4)  # batch x (1 + k) at most MAX_CAPTURE tokens
    assert big[0] * 4 <= MAX_CAPTURE < (big[0] + 8) * 4 and big[-1] == 1
    captured: list = []
    graphs = _graphs(TinyModel(), captured)
    assert graphs.query_lens == [1, Q] and len(captured) == 8  # 4 decode + 4 verification
    assert graphs.can_run(3, 3 * Q, WIDTH, Q) and graphs.size_for(3, 3 * Q, WIDTH, Q) == 4
    assert not graphs.can_run(3, 3 * Q - 1, WIDTH, Q)  # not q tokens per sequence
    assert not graphs.can_run(3, 9, WIDTH, 3)  # a query length that was not captured
    assert not graphs.can_run(9, 9 * Q, WIDTH, Q)  # past the ladder


@pytest.mark.parametrize("q_lens", [[Q], [Q, Q, Q], [Q] * 5, [1, Q, 2], [3, 1, 1, Q, 2]],
                         ids=["one", "uniform3", "uniform5", "ragged3", "ragged5"])
def test_verification_replay_equals_eager(q_lens):
    """Each real token's hidden state and every KV write are the eager step's; a ragged step
    is padded (pad tokens write nothing, their rows are dropped) and replays the q graph of
    the next batch size."""
    graphed, eager = TinyModel(), TinyModel()
    graphs = _graphs(graphed)
    ids, pos, slots, tables, seq_lens, qsl = _batch(q_lens, seed=len(q_lens))
    n = len(q_lens)
    b = pad_to_uniform(qsl, Q, ids, pos, slots, seq_lens, None)
    assert (b.rows is None) == (q_lens == [Q] * n)
    size = graphs.size_for(n, n * Q, WIDTH, Q)
    got = graphs.run(b.input_ids, b.positions, b.slot_mapping, tables, b.seq_lens, None,
                     size, None, Q)
    if b.rows is not None:
        got = got[b.rows]
    want = _eager(eager, ids, pos, slots, tables, seq_lens, qsl)
    assert got.shape == want.shape == (len(ids), D)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(graphed.k_cache, eager.k_cache)  # pads wrote nothing
    torch.testing.assert_close(graphed.v_cache, eager.v_cache)
    assert graphs.replayed == {(size, Q): 1}
    assert size == min(s for s in graphs.ladders[Q] if s >= n)


def test_engine_verification_steps_replay_the_verification_graphs(tiny_model_dir):
    """The whole engine with ngram speculation and the stand-in capture (through core_setup,
    which captures 1 + num_speculative_tokens per sequence): verification steps replay the
    q = 4 graphs, decode steps the decode ones, and the greedy tokens and logprobs are those
    of the eager speculative engine and of plain decoding."""
    from conftest import make_llm
    from kvserve import SamplingParams
    from kvserve.engine.core.core_setup import capture_decode_graphs

    spec = {"method": "ngram", "num_speculative_tokens": Q - 1, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive": False}
    kw = dict(attention_backend="triton", max_num_seqs=4, max_model_len=64)
    prompts = ["the cat sat on the mat and the cat sat on the", "x y x y x y x y",
               "a dog ran far away"]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)
    want = make_llm(tiny_model_dir, **kw).generate(prompts, params)
    eager = make_llm(tiny_model_dir, speculative_config=dict(spec), **kw)
    assert_same_outputs(eager.generate(prompts, params), want)
    llm = make_llm(tiny_model_dir, speculative_config=dict(spec), **kw)
    capture_decode_graphs(llm.llm_engine.core, lambda fn: fn)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.ladders == {1: [4, 2, 1], Q: [4, 2, 1]}
    assert_same_outputs(llm.generate(prompts, params), want)
    verified = sum(n for (size, q), n in graphs.replayed.items() if q == Q)
    assert verified > 0 and llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0
    # drafts from the reference with planted errors: full, partial and rejected runs, every
    # step a verification of uniform or uneven draft lengths
    llm.llm_engine.core.spec.proposer = Reference(want)
    before = dict(graphs.replayed)
    assert_same_outputs(llm.generate(prompts, params), want)
    verified = {k: n - before.get(k, 0) for k, n in graphs.replayed.items() if k[1] == Q}
    assert sum(verified.values()) >= 4 and (4, Q) in verified


class Reference(Proposer):
    """Drafts the reference continuation, lengths 1..3 in turn, every third one wrong."""

    method = "reference"

    def __init__(self, outputs) -> None:
        self.full = {tuple(o.prompt_token_ids): list(o.prompt_token_ids)
                     + list(o.outputs[0].token_ids) for o in outputs}
        self.calls = 0

    def propose(self, requests, num_tokens):
        out = []
        for r in requests:
            self.calls += 1
            tokens = r.token_ids.tolist()
            full = self.full.get(tuple(tokens[:r.num_prompt_tokens]), [])
            draft = full[len(tokens):len(tokens) + min(num_tokens, 1 + self.calls % 3)]
            if draft and self.calls % 3 == 0:
                draft[-1] = (draft[-1] + 1) % VOCAB
            out.append(draft)
        return out


def test_verification_ladder_per_method():
    """1 + k tokens per sequence for every method but EAGLE-3 (its layer hooks do not run in a
    replay, so its verification steps stay eager); none without speculation."""
    from kvserve.engine.core.core_setup import graph_query_lens
    from kvserve.engine.spec_decode.config import SpeculativeConfig

    assert graph_query_lens(None) == ()
    assert graph_query_lens(SpeculativeConfig(method="ngram", num_speculative_tokens=3)) == (4,)
    assert graph_query_lens(SpeculativeConfig(method="suffix", num_speculative_tokens=5)) == (6,)
    assert graph_query_lens(SpeculativeConfig(method="eagle", model="m",
                                              num_speculative_tokens=2)) == (3,)
    assert graph_query_lens(SpeculativeConfig(method="eagle3", model="m",
                                              num_speculative_tokens=2)) == ()


def test_a_failed_verification_capture_keeps_the_decode_graphs(tiny_model_dir, caplog):
    """The verification ladder is captured first (largest first); if it fails, every rank
    captures the decode ladder alone and verification steps run eagerly, said in the log."""
    import logging

    from conftest import make_llm
    from kvserve.engine.core.core_setup import capture_decode_graphs

    calls = []

    def first_fails(fn):
        calls.append(fn)
        if len(calls) == 1:
            raise RuntimeError("injected: an op that cannot be captured")
        return fn

    caplog.set_level(logging.INFO, logger="kvserve.engine")
    llm = make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4, max_model_len=64,
                   speculative_config={"method": "ngram", "num_speculative_tokens": Q - 1})
    capture_decode_graphs(llm.llm_engine.core, first_fails)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.ladders == {1: [4, 2, 1]}
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"CUDA graphs with ({Q},) tokens per sequence not captured" in m
               and "injected" in m for m in lines), lines
    assert "CUDA graphs: captured for decode at batch sizes 4, 2, 1" in lines

"""Decode graphs on the CPU: the ladder, the staging and padding, and the eager fallback, with a
stand-in capture (a plain call in place of CUDAGraph replay) over the real Triton decode kernel
in the interpreter, against the eager forward of the unpadded batch."""

import pytest
import torch

from graph_checks import TinyAttentionModel, interpreter  # noqa: F401 - autouse fixture
from kvserve.engine.worker.cuda_graph import (DecodeBuffers, DecodeGraphs, capture_sizes,
                                              decode_plan, fill_staging, padded_size)
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.plan import plan_attention

BS, WIDTH, HEADS, KV_HEADS, D, VOCAB = 4, 4, 4, 2, 16, 50


def test_capture_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [6, 4, 2, 1]  # the top rung is max_num_seqs itself
    assert capture_sizes(40) == [40, 32, 24, 16, 8, 4, 2, 1]
    big = capture_sizes(10_000)
    assert big[0] == 512 and big == sorted(big, reverse=True) and len(set(big)) == len(big)
    assert {248, 256, 272, 288} <= set(big) and 264 not in big  # steps of 16 past 256
    assert capture_sizes(300)[:3] == [300, 288, 272]
    assert padded_size(3, capture_sizes(40)) == 4
    assert padded_size(17, capture_sizes(40)) == 24
    assert padded_size(41, capture_sizes(40)) is None


def test_staging_pads_with_dead_rows():
    st = DecodeBuffers.empty(8, WIDTH, "cpu")
    st.slot_mapping.fill_(99)  # stale values from an earlier, larger step
    st.seq_lens.fill_(99)
    st.block_tables.fill_(7)
    ids = torch.tensor([5, 6, 7])
    st.lora_slots.fill_(5)
    fill_staging(st, 4, ids, torch.tensor([3, 1, 8]), torch.tensor([3, 5, 12]),
                 torch.tensor([[0, 0], [1, 0], [2, 3]], dtype=torch.int32),
                 torch.tensor([4, 2, 9], dtype=torch.int32), torch.tensor([1, -1, 0]))
    assert st.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert st.slot_mapping[:4].tolist() == [3, 5, 12, -1]
    assert st.seq_lens[:4].tolist() == [4, 2, 9, 0]
    assert st.lora_slots[:4].tolist() == [1, -1, 0, -1]  # a padded row: no adapter
    assert st.block_tables[:4].tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [2, 3, 0, 0],
                                            [0, 0, 0, 0]]


def TinyDecoder() -> TinyAttentionModel:  # noqa: N802 - a model class's stand-in
    """The parts of a decode forward that see the padding (slots, lengths, block tables)."""
    return TinyAttentionModel(VOCAB, 16, BS, HEADS, KV_HEADS, D, backend="triton")


def _batch(n: int):
    g = torch.Generator().manual_seed(n)
    seq_lens = torch.randint(1, WIDTH * BS + 1, (n,), generator=g, dtype=torch.int32)
    tables = torch.stack([torch.randperm(15, generator=g)[:WIDTH] + 1 for _ in range(n)])
    tables = tables.to(torch.int32)
    pos = seq_lens.long() - 1
    slots = tables[torch.arange(n), pos // BS].long() * BS + pos % BS
    return torch.randint(0, VOCAB, (n,), generator=g), pos, slots, tables, seq_lens


def _eager(model, ids, pos, slots, tables, seq_lens):
    qsl = torch.arange(len(ids) + 1, dtype=torch.int32)
    meta = AttentionMetadata(slots, tables, seq_lens, qsl, 1, int(seq_lens.max()),
                             backend=model.backend,
                             plan=plan_attention(tables, seq_lens, qsl, BS, 1, None))
    return model(ids, pos, meta)


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_replay_equals_eager_with_padded_rows_dropped(n):
    graphed, eager = TinyDecoder(), TinyDecoder()
    captured = []
    graphs = DecodeGraphs(graphed, max_num_seqs=8, max_blocks_per_seq=WIDTH, block_size=BS,
                          device=torch.device("cpu"), backend="triton",
                          capture=lambda fn: captured.append(fn) or fn)
    assert len(captured) == 4 and graphs.sizes == [8, 4, 2, 1]
    k_before = graphed.k_cache.clone()
    batch = _batch(n)
    assert graphs.can_run(n, n, WIDTH)
    got = graphs.run(*batch)
    want = _eager(eager, *batch)
    assert got.shape == want.shape == (n, D)
    torch.testing.assert_close(got, want)
    # Padded rows wrote nothing (slot -1): the caches differ from before only where eager wrote.
    torch.testing.assert_close(graphed.k_cache, eager.k_cache)
    assert not torch.equal(graphed.k_cache, k_before)


def test_prefill_mixed_and_larger_batches_fall_back_to_eager():
    graphs = DecodeGraphs(TinyDecoder(), 8, WIDTH, BS, torch.device("cpu"),
                          capture=lambda fn: fn, backend="triton")
    assert not graphs.can_run(3, 7, WIDTH)  # a prefill or mixed step: more tokens than seqs
    assert not graphs.can_run(9, 9, WIDTH)  # past the largest captured size
    assert not graphs.can_run(2, 2, WIDTH + 1)  # a table wider than the captured one
    assert not graphs.can_run(0, 0, WIDTH)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_padded_rows_give_zeros(num_splits):
    """Rows of length 0 (the graph's padding) come out as zeros, not NaN, split or not."""
    from kvserve.kernels.triton_attention import triton_paged_attention

    bufs = DecodeBuffers.empty(4, WIDTH, "cpu")
    bufs.seq_lens[:2] = torch.tensor([5, 9], dtype=torch.int32)
    bufs.block_tables[:2] = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    plan = decode_plan(bufs, 4, BS, WIDTH * BS, qsl)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, HEADS, D, generator=g)
    kc, vc = torch.randn(16, BS, KV_HEADS, D, generator=g), torch.randn(16, BS, KV_HEADS, D,
                                                                        generator=g)
    out = triton_paged_attention(q, kc, vc, plan, D ** -0.5, num_splits=num_splits)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    want = paged_attention(q[:2], kc, vc, bufs.block_tables[:2], bufs.seq_lens[:2], qsl[:3],
                           D ** -0.5, backend="reference")
    torch.testing.assert_close(out[:2], want)


def graph_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("CUDA graphs:")]


def test_engine_decode_through_graphs_matches_eager(tiny_model_dir, caplog):
    """The whole engine with the stand-in capture: the same greedy tokens and logprobs as the
    eager run, with decode steps of 1..3 sequences replayed from the padded [4, 2, 1] ladder.
    The start-up log says a CPU engine captured no graphs, and a capture names its sizes."""
    import logging

    from conftest import make_llm
    from kvserve import SamplingParams

    caplog.set_level(logging.INFO, logger="kvserve.engine")
    llm = make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4, max_model_len=64)
    assert graph_lines(caplog) == ["CUDA graphs: not captured (device cpu; CUDA only); decode "
                                   "runs eagerly"]
    caplog.clear()
    prompts = ["the cat sat", "a dog ran far away", "hello"]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)
    want = llm.generate(prompts, params)
    replays = []

    def stand_in(fn):
        return lambda: replays.append(1) or fn()

    runner = llm.llm_engine.runner
    runner.capture_decode_graphs(4, 64, capture=stand_in)
    assert runner.graphs is not None and runner.graphs.sizes == [4, 2, 1]
    assert graph_lines(caplog) == ["CUDA graphs: captured for decode at batch sizes 4, 2, 1"]
    got = llm.generate(prompts, params)
    assert replays  # decode steps went through the graphs
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4


def test_eager_reasons_and_the_failed_capture_line():
    from kvserve.engine.worker.cuda_graph import eager_reason, graphs_log_line

    assert eager_reason("cuda", False, "triton") is None  # the one case that captures
    assert eager_reason("cuda", True, "triton") == "--enforce-eager"
    assert eager_reason("cuda", False, "torch") == "attention backend torch; captured with " \
        "triton only"
    assert graphs_log_line(None) == "CUDA graphs: not captured (the capture failed); decode " \
        "runs eagerly"


def test_enforce_eager_flag_reaches_the_engine_config():
    from kvserve.engine.config import EngineConfig
    from kvserve.service.cli import build_parser, engine_config_from_args

    parser = build_parser()
    assert EngineConfig().enforce_eager is False
    eager = parser.parse_args(["serve", "m", "--enforce-eager"])
    assert engine_config_from_args(eager).enforce_eager is True
    assert engine_config_from_args(parser.parse_args(["serve", "m"])).enforce_eager is False


def test_async_scheduling_fills_graph_inputs_on_the_device(tiny_model_dir):
    """Async scheduling through the graphs: each decode step is staged (two staging sets in
    turn) while the previous one is in flight, and its input tokens are written into the static
    buffer from the previous step's sampled ids; the tokens and logprobs are the eager ones."""
    from conftest import make_llm
    from kvserve import SamplingParams

    prompts = ["the cat sat", "a dog ran far away", "hello"]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    want = make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4,
                    max_model_len=64).generate(prompts, params)
    llm = make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4, max_model_len=64,
                   async_scheduling=True)
    runner = llm.llm_engine.runner
    runner.capture_decode_graphs(4, 64, capture=lambda fn: fn)
    got = llm.generate(prompts, params)
    assert runner.graphs.replays >= 7 and llm.llm_engine._stepper.overlapped_steps >= 6
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4

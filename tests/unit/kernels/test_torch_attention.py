"""The torch fast path against the reference on hypothesis-drawn mixed batches."""

from dataclasses import replace

import torch
from hypothesis import given, settings

from kv_batches import MIXED, Spec, assert_matches_reference, build_batch, specs
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.plan import plan_attention


@settings(max_examples=30, deadline=None)
@given(specs())
def test_torch_matches_reference(spec):
    batch = build_batch(spec)
    assert_matches_reference(batch.args(), "torch")


def test_one_plan_serves_every_layer():
    """A plan made once per step is reused over layers with different caches and queries."""
    first = build_batch(MIXED)
    layers = [first] + [replace(first, q=torch.randn_like(first.q),
                                k_cache=torch.randn_like(first.k_cache),
                                v_cache=torch.randn_like(first.v_cache)) for _ in range(2)]
    plan = plan_attention(first.block_tables, first.seq_lens, first.query_start_loc, 16,
                          max_query_len=17, max_seq_len=70)
    for layer in layers:
        assert_matches_reference(layer.args(), "torch", plan=plan)


def test_many_decodes_of_mixed_lengths_span_several_chunks():
    """Chunking by gathered bytes: a small chunk budget must give the same result."""
    from kvserve.kernels.torch_plan import torch_plan

    spec = Spec(seqs=tuple((n, 1) for n in (5, 200, 31, 128, 1, 64, 99, 16)), num_kv_heads=2,
                group=4, head_dim=64, block_size=8, cache_dtype=torch.float32,
                q_dtype=torch.float32, seed=4)
    batch = build_batch(spec)
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 8)
    token_bytes = 2 * 2 * 64 * 4
    assert len(torch_plan(plan, token_bytes, chunk_bytes=64 * token_bytes).decode) > 2
    assert_matches_reference(batch.args(), "torch", plan=plan)


def test_empty_batch_gives_empty_output():
    spec = Spec(seqs=((4, 1),), num_kv_heads=1, group=2, head_dim=64, block_size=8,
                cache_dtype=torch.float32, q_dtype=torch.float32)
    batch = build_batch(spec)
    empty = torch.zeros(0, dtype=torch.int32)
    out = paged_attention(batch.q[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0], empty,
                          torch.zeros(1, dtype=torch.int32), batch.scale)
    assert out.shape == (0, 2, 64)

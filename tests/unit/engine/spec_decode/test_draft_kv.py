"""The drafting models' own KV pool: no block is lost or shared under any sequence of
allocations and frees, and growing the pool keeps every stream's cached K/V."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.spec_decode.draft_kv import DraftKV


def _pool(initial: int = 2) -> DraftKV:
    return DraftKV(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                   device=torch.device("cpu"), block_size=4, initial_blocks=initial,
                   attention_backend="torch")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ensure", "free"]), st.integers(0, 4),
                          st.integers(1, 40)), max_size=30))
def test_blocks_are_never_lost_or_shared(ops):
    kv = _pool()
    for op, stream, n in ops:
        sid = f"s{stream}"
        if op == "ensure":
            kv.ensure(sid, n)
            assert len(kv.tables[sid]) >= -(-n // kv.block_size)
        else:
            kv.free(sid)
        held = [b for t in kv.tables.values() for b in t]
        assert len(set(held)) == len(held)
        assert sorted(held + kv.free_blocks) == list(range(kv.num_blocks))


def test_growing_keeps_the_cached_values():
    kv = _pool(initial=1)
    kv.ensure("a", 4)
    block = kv.tables["a"][0]
    kv.runner.kv[:, :, block] = 7.0
    kv.ensure("b", 40)  # needs 10 more blocks: the pool grows
    assert kv.num_blocks >= 11
    assert torch.all(kv.runner.kv[:, :, kv.tables["a"][0]] == 7.0)
    assert kv.nbytes == kv.runner.kv.numel() * 4

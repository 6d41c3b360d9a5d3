"""Builders for paged-attention test batches: random caches, shuffled and shared block tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from kvserve.kernels.attention import paged_attention
from kvserve.kernels.fp8 import FP8_DTYPE as FP8
from kvserve.kernels.reference import quantize

# (atol, rtol) against the fp32 reference, by the dtype the attention computes in.
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 4e-3),
             torch.bfloat16: (4e-2, 4e-2)}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    k_scale: float = 1.0
    v_scale: float = 1.0

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale, self.k_scale, self.v_scale)


@dataclass(frozen=True)
class Spec:
    seqs: tuple[tuple[int, int], ...]  # (seq_len, query_len) per sequence
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    cache_dtype: torch.dtype
    q_dtype: torch.dtype
    shared_blocks: int = 0  # leading full blocks every sequence shares with the first
    seed: int = 0


# Decodes of several lengths, a chunked prefill and a whole prompt, over two shared blocks.
MIXED = Spec(seqs=((70, 1), (3, 1), (45, 1), (64, 9), (17, 17)), num_kv_heads=3, group=3,
             head_dim=64, block_size=16, cache_dtype=torch.float32, q_dtype=torch.float32,
             shared_blocks=2, seed=11)


def build_batch(spec: Spec) -> Batch:
    """Random K/V everywhere in the pool (so a wrong read shows), tables from a shuffled pool."""
    gen = torch.Generator().manual_seed(spec.seed)
    bs = spec.block_size
    tables = _block_tables(spec, gen)
    num_blocks = int(tables.max()) + 3
    shape = (num_blocks, bs, spec.num_kv_heads, spec.head_dim)
    k_scale, v_scale = (0.5, 0.25) if spec.cache_dtype == FP8 else (1.0, 1.0)
    k_cache = quantize(torch.randn(shape, generator=gen) * 2, k_scale, spec.cache_dtype)
    v_cache = quantize(torch.randn(shape, generator=gen), v_scale, spec.cache_dtype)
    qlens = torch.tensor([ql for _, ql in spec.seqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(qsl[-1]), spec.num_kv_heads * spec.group, spec.head_dim, generator=gen)
    seq_lens = torch.tensor([sl for sl, _ in spec.seqs], dtype=torch.int32)
    return Batch(q.to(spec.q_dtype), k_cache, v_cache, tables, seq_lens, qsl,
                 spec.head_dim ** -0.5, k_scale, v_scale)


def _block_tables(spec: Spec, gen: torch.Generator) -> torch.Tensor:
    bs = spec.block_size
    need = [-(-sl // bs) for sl, _ in spec.seqs]
    width = max(need) + 1  # one spare column of padding, as the engine's tables have
    shared = min([spec.shared_blocks] + [sl // bs for sl, _ in spec.seqs])
    pool = torch.randperm(sum(need) + width, generator=gen).tolist()
    prefix, pool = pool[:shared], pool[shared:]
    rows = []
    for n in need:
        own, pool = pool[: n - shared], pool[n - shared:]
        row = prefix + own
        rows.append(row + [0] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32)


@st.composite
def seq_shapes(draw: st.DrawFn, max_len: int = 70) -> tuple[int, int]:
    kind = draw(st.sampled_from(["decode", "prefill", "chunked"]))
    seq_len = draw(st.integers(1 if kind != "chunked" else 3, max_len))
    if kind == "decode":
        return seq_len, 1
    if kind == "prefill":
        return seq_len, seq_len
    return seq_len, draw(st.integers(2, seq_len - 1))


@st.composite
def specs(draw: st.DrawFn, max_seqs: int = 5, max_len: int = 70,
          head_dims: tuple[int, ...] = (64, 80, 96, 128)) -> Spec:
    cache_dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, FP8]))
    q_dtype = cache_dtype
    if cache_dtype == FP8:
        q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return Spec(seqs=tuple(draw(st.lists(seq_shapes(max_len), min_size=1, max_size=max_seqs))),
                num_kv_heads=draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 2, 3, 4])),
                head_dim=draw(st.sampled_from(head_dims)),
                block_size=draw(st.sampled_from([8, 16, 32])), cache_dtype=cache_dtype,
                q_dtype=q_dtype, shared_blocks=draw(st.integers(0, 2)),
                seed=draw(st.integers(0, 2**16)))


def assert_close_to(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    atol, rtol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def assert_matches_reference(args: tuple, backend: str, **kw: Any) -> None:
    """paged_attention(*args) on `backend` (with `kw`, e.g. a plan) is close to the reference's."""
    expected = paged_attention(*args, backend="reference")
    assert_close_to(paged_attention(*args, backend=backend, **kw), expected)


def dense_rows(batch: Batch, s: int, window: int | None,
               weights: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sequence s's new rows over its contiguous K/V (fp32), one query row at a time:
    `weights` turns a row's scaled scores [heads, keys] into its attention weights."""
    bs = batch.k_cache.shape[1]
    seq_len = int(batch.seq_lens[s])
    start, end = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
    blocks = batch.block_tables[s, : -(-seq_len // bs)].long()
    k = batch.k_cache[blocks].float().flatten(0, 1)[:seq_len] * batch.k_scale
    v = batch.v_cache[blocks].float().flatten(0, 1)[:seq_len] * batch.v_scale
    q = batch.q[start:end].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for r in range(end - start):
        pos = seq_len - (end - start) + r
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,khd->hk", q[r], k[lo:pos + 1]) * batch.scale
        out[r] = torch.einsum("hk,khd->hd", weights(scores), v[lo:pos + 1])
    return out

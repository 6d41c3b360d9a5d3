"""Helpers for the decode-graph tests on the CPU: the Triton kernels in the interpreter, a
stand-in capture (a plain call in place of CUDAGraph replay) that counts replays per rank, and
the graphs-vs-eager comparison."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import triton_interpreted


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """The Triton kernels interpreted on CPU tensors, on a machine with a GPU too (as in
    tests/unit/kernels/test_triton.py): set for the module, the modules reloaded around it."""
    with triton_interpreted("kvserve.kernels.triton_attention", "kvserve.kernels.triton_cache"):
        yield


class StandIn:
    """The capture of the CPU tests: `capture(fn)` returns a replay that calls fn (no graph),
    and counts each rank's replays in a file of `folder` (picklable: the engine sends it to the
    tensor-parallel workers, spawned processes). `fail_rank`'s capture raises, as an op that
    cannot be captured would."""

    def __init__(self, folder: Path, fail_rank: int | None = None) -> None:
        self.folder, self.fail_rank = folder, fail_rank

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == self.fail_rank:
            raise RuntimeError(f"injected capture failure on rank {rank}")
        log = self.folder / f"rank{rank}"

        def replay() -> torch.Tensor:
            with open(log, "a") as f:
                f.write(".")
            return fn()
        return replay

    def counts(self, ranks: int) -> list[int]:
        """Replays per rank so far."""
        return [(self.folder / f"rank{r}").stat().st_size
                if (self.folder / f"rank{r}").exists() else 0 for r in range(ranks)]


class TinyAttentionModel:
    """Embedding -> q, k, v -> KV write -> paged attention -> sum over heads: the parts of a
    forward that see the layout (slots, lengths, block tables, query starts). `backend`: the
    attention kernel (None: the metadata's)."""

    def __init__(self, vocab: int, num_blocks: int, block_size: int, heads: int, kv_heads: int,
                 head_dim: int, backend: str | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.heads, self.kv_heads, self.d, self.backend = heads, kv_heads, head_dim, backend
        self.emb = torch.randn(vocab, (heads + 2 * kv_heads) * head_dim, generator=g)
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)

    def __call__(self, ids, positions, meta, lora=None) -> torch.Tensor:
        from kvserve.kernels.attention import paged_attention
        from kvserve.kernels.write_kv import write_kv

        h, kvh, d = self.heads, self.kv_heads, self.d
        qkv = self.emb[ids] + positions[:, None]
        q = qkv[:, :h * d].reshape(-1, h, d)
        k = qkv[:, h * d:(h + kvh) * d].reshape(-1, kvh, d)
        v = qkv[:, (h + kvh) * d:].reshape(-1, kvh, d)
        write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, backend="torch")
        out = paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, d ** -0.5,
                              backend=self.backend or meta.backend, plan=meta.plan)
        return out.sum(1)


def assert_same_outputs(got, want, tol: float = 1e-4) -> None:
    """The same greedy tokens, and each sampled token's logprob within `tol`."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs)
        for lg, lw, tok in zip(g.outputs[0].logprobs, w.outputs[0].logprobs,
                               w.outputs[0].token_ids):
            assert abs(lg[tok].logprob - lw[tok].logprob) < tol

"""Attention sinks (gpt-oss): the reference against a dense softmax with one extra per-head logit
whose weight is dropped, then every backend (torch path, CPU backend, Triton in the
interpreter, split-KV included) against the reference, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from kv_batches import FP8, Spec, assert_close_to, build_batch, dense_rows
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.backend import cpu_kernel_available
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.plan import plan_attention

# Decodes, a chunked prefill over a cached context, a whole prompt, a one-token sequence.
SEQS = ((70, 1), (5, 1), (40, 13), (33, 33), (1, 1))
HEADS = 4  # 2 KV heads x group 2


def sinks_for(seed: int = 0) -> torch.Tensor:
    """Logits around the scores' size: large enough to take a visible share of each row."""
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * 2.0


def dense(batch, s: int, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """Sequence s's rows by HF's eager formula: softmax over [scores, sink], sink dropped."""
    return dense_rows(batch, s, window, lambda scores: torch.cat(
        (scores, sinks[:, None]), dim=-1).softmax(-1)[:, :-1])


def spec(dtype=torch.float32, q_dtype=None, seed=3) -> Spec:
    return Spec(seqs=SEQS, num_kv_heads=2, group=2, head_dim=32, block_size=8,
                cache_dtype=dtype, q_dtype=q_dtype or dtype, shared_blocks=1, seed=seed)


@pytest.mark.parametrize("window", [None, 7])
def test_reference_is_the_dense_softmax_with_a_sink(window):
    batch = build_batch(spec())
    sinks = sinks_for()
    out = paged_attention(*batch.args(), backend="reference", sliding_window=window, sinks=sinks)
    for s in range(len(SEQS)):
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        torch.testing.assert_close(out[a:b], dense(batch, s, sinks, window), atol=1e-5,
                                   rtol=1e-5)


def test_sinks_shrink_the_output_and_a_very_negative_one_is_no_sink():
    batch = build_batch(spec())
    plain = paged_attention(*batch.args(), backend="reference")
    sunk = paged_attention(*batch.args(), backend="reference", sinks=torch.full((HEADS,), 3.0))
    # every row's weights sum to less than 1: the output is a shrunk average of the values
    assert (plain - sunk).abs().max() > 1e-2
    assert sunk.norm() < plain.norm()
    none = paged_attention(*batch.args(), backend="reference",
                           sinks=torch.full((HEADS,), -1e4))
    torch.testing.assert_close(none, plain)


def _backends() -> list[str]:
    return ["torch", "triton"] + (["cpu"] if cpu_kernel_available() else [])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype,q_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                           (FP8, torch.bfloat16)], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window", [None, 7])
def test_backend_matches_reference(backend, dtype, q_dtype, window):
    batch = build_batch(spec(dtype, q_dtype))
    opts = {"sliding_window": window, "sinks": sinks_for(1)}
    expected = paged_attention(*batch.args(), backend="reference", **opts)
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.k_cache.shape[1])
    assert_close_to(paged_attention(*batch.args(), backend=backend, plan=plan, **opts), expected)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_split_kv_decode_counts_the_sink_once(num_splits):
    from kvserve.kernels.triton_attention import triton_paged_attention

    batch = build_batch(Spec(seqs=((70, 1), (9, 1), (33, 1)), num_kv_heads=2, group=4,
                             head_dim=32, block_size=16, cache_dtype=torch.float32,
                             q_dtype=torch.float32, seed=9))
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) * 2.0
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    expected = paged_attention(*batch.args(), backend="reference", sinks=sinks)
    out = triton_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale,
                                 num_splits=num_splits, sinks=sinks)
    assert_close_to(out, expected)


@pytest.mark.parametrize("sinks", [torch.zeros(3), torch.zeros(HEADS, 1),
                                   torch.zeros(HEADS, dtype=torch.int64),
                                   torch.tensor([0.0, float("nan"), 0.0, 0.0])],
                         ids=["heads", "dims", "dtype", "nan"])
def test_bad_sinks_name_the_argument(sinks):
    batch = build_batch(spec())
    with pytest.raises(KernelInputError) as err:
        paged_attention(*batch.args(), backend="torch", sinks=sinks)
    assert err.value.argument == "sinks"

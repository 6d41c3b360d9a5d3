"""Sliding windows and attention-logit soft caps: the reference against a dense masked softmax,
then every backend (torch path, CPU backend, Triton in the interpreter) against the reference on
decodes, whole prompts and chunked prefills that cross the window boundary."""

from __future__ import annotations

import pytest
import torch

from kv_batches import FP8, Spec, assert_close_to, build_batch, dense_rows
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.backend import cpu_kernel_available
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.plan import plan_attention

# Decodes far past the window, a chunked prefill whose chunk starts before the window ends and
# one past it, a whole prompt longer than the window, and a short sequence inside the window.
SEQS = ((70, 1), (5, 1), (45, 1), (40, 13), (33, 33), (26, 3))


def dense(batch, s: int, window: int | None, cap: float | None) -> torch.Tensor:
    """Sequence s's new rows by a plain masked softmax over its contiguous K/V (fp32)."""
    def weights(scores: torch.Tensor) -> torch.Tensor:
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        return scores.softmax(-1)

    return dense_rows(batch, s, window, weights)


def spec(dtype=torch.float32, q_dtype=None, block_size=8, seed=3) -> Spec:
    return Spec(seqs=SEQS, num_kv_heads=2, group=2, head_dim=32, block_size=block_size,
                cache_dtype=dtype, q_dtype=q_dtype or dtype, shared_blocks=1, seed=seed)


@pytest.mark.parametrize("window,cap", [(7, None), (1, None), (16, 5.0), (None, 2.0),
                                        (200, None)])
def test_reference_is_the_dense_masked_softmax(window, cap):
    batch = build_batch(spec())
    out = paged_attention(*batch.args(), backend="reference", sliding_window=window,
                          logits_soft_cap=cap)
    for s in range(len(SEQS)):
        a, b = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        torch.testing.assert_close(out[a:b], dense(batch, s, window, cap), atol=1e-5, rtol=1e-5)


def test_window_and_cap_change_the_output():
    """The options are not ignored: each moves the result of a long sequence."""
    batch = build_batch(spec())
    plain = paged_attention(*batch.args(), backend="reference")
    windowed = paged_attention(*batch.args(), backend="reference", sliding_window=7)
    capped = paged_attention(*batch.args(), backend="reference", logits_soft_cap=1.0)
    assert (plain - windowed).abs().max() > 1e-2 and (plain - capped).abs().max() > 1e-2
    # A window longer than every sequence is no window at all.
    wide = paged_attention(*batch.args(), backend="reference", sliding_window=70)
    torch.testing.assert_close(wide, plain)


def _backends() -> list[str]:
    return ["torch", "triton"] + (["cpu"] if cpu_kernel_available() else [])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype,q_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                           (FP8, torch.bfloat16)], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("window,cap", [(7, None), (16, 5.0), (None, 2.0), (1, None)])
def test_backend_matches_reference(backend, dtype, q_dtype, window, cap):
    batch = build_batch(spec(dtype, q_dtype))
    opts = {"sliding_window": window, "logits_soft_cap": cap}
    expected = paged_attention(*batch.args(), backend="reference", **opts)
    # One plan serves layers with and without options (the engine plans once per step).
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.k_cache.shape[1])
    plain = paged_attention(*batch.args(), backend=backend, plan=plan)
    assert_close_to(paged_attention(*batch.args(), backend=backend, plan=plan, **opts), expected)
    assert_close_to(plain, paged_attention(*batch.args(), backend="reference"))


@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_split_kv_decode_with_window_and_cap(num_splits):
    """Splits wholly before the window are empty; the merge must ignore them."""
    from kvserve.kernels.triton_attention import triton_paged_attention

    batch = build_batch(Spec(seqs=((70, 1), (9, 1), (33, 1)), num_kv_heads=2, group=4,
                             head_dim=32, block_size=16, cache_dtype=torch.float32,
                             q_dtype=torch.float32, seed=9))
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    expected = paged_attention(*batch.args(), backend="reference", sliding_window=12,
                               logits_soft_cap=3.0)
    out = triton_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale,
                                 num_splits=num_splits, sliding_window=12, logits_soft_cap=3.0)
    assert_close_to(out, expected)


@pytest.mark.parametrize("kw,argument", [({"sliding_window": 0}, "sliding_window"),
                                         ({"sliding_window": 2.5}, "sliding_window"),
                                         ({"logits_soft_cap": 0.0}, "logits_soft_cap"),
                                         ({"logits_soft_cap": float("inf")}, "logits_soft_cap")])
def test_bad_options_name_the_argument(kw, argument):
    batch = build_batch(spec())
    with pytest.raises(KernelInputError) as err:
        paged_attention(*batch.args(), backend="torch", **kw)
    assert err.value.argument == argument

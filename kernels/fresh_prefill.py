"""Fresh prefills through torch's own attention: a sequence with no cached prefix (all of its
tokens are new this step) attends over the contiguous K/V the layer just projected, so it needs
no block table. On a GPU that is FlashAttention: `torch.nn.attention.varlen.varlen_attn` over
every fresh sequence of the step in one call, where the installed torch has it (else one SDPA per
sequence). Sequences with a cached prefix (prefix caching, chunked prefill) and decode rows go
through the backend's paged kernel, on a sub-plan of those sequences only.

Which calls take it (`route`): the key/value of the new tokens are given, the batch has a
sequence with more than one new token, the layer has no sliding window, soft cap or sinks
(FlashAttention's plain causal softmax), and the cache is not fp8 (the paged kernel would read
rounded keys; SDPA the unrounded ones). Backends: "triton" (GPU), and the CPU backends for the
cache dtypes in CPU_BACKENDS, where bench/fresh_prefill_cpu.py measured SDPA faster.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.plan import AttentionPlan

logger = logging.getLogger("kvserve.kernels")

# CPU backends that send fresh prefills to SDPA, and for which cache dtypes: measured by
# bench/fresh_prefill_cpu.py (docs/perf/gpu.md). SDPA beat the torch path's per-sequence bmm's
# 4-30x in fp32 and bf16, and the C++ prefill kernel ("cpu") 2-3x in bf16, but not in fp32 (0.6-1.5x
# from run to run): there the C++ kernel stays.
CPU_BACKENDS: dict[str, frozenset[torch.dtype]] = {
    "torch": frozenset({torch.float32, torch.bfloat16, torch.float16}),
    "cpu": frozenset({torch.bfloat16}),
}
GPU_BACKENDS = frozenset({"triton"})
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FreshSplit:
    """One step's fresh sequences and the rest, computed once per plan (shared by all layers)."""

    fresh: list[int]  # batch indices of fresh sequences (every token new, more than one)
    all_fresh: bool  # every sequence of the batch is fresh: no gather, no sub-plan
    fresh_tokens: torch.Tensor  # int64 [n]: their rows of q / key / value, in order
    fresh_lens: list[int]  # their lengths (host side)
    fresh_qsl: torch.Tensor  # int32 [len(fresh) + 1]: their offsets within fresh_tokens
    rest_tokens: torch.Tensor | None  # int64 rows of the other sequences (None: there are none)
    rest_plan: AttentionPlan | None  # the paged kernel's plan over the other sequences


def route(plan: AttentionPlan, backend: str, cache_dtype: torch.dtype, has_new_kv: bool,
          layer_options: bool) -> bool:
    """Whether this call sends its fresh sequences to torch's attention (see the module doc)."""
    if not has_new_kv or layer_options or cache_dtype == FP8_DTYPE or plan.max_query_len < 2:
        return False
    if backend not in GPU_BACKENDS and cache_dtype not in CPU_BACKENDS.get(backend, ()):
        return False
    return fresh_split(plan) is not None


def fresh_split(plan: AttentionPlan) -> FreshSplit | None:
    """The plan's fresh/rest split (None when no sequence is fresh), cached in plan.parts."""
    if "fresh" not in plan.parts:
        plan.parts["fresh"] = _split(plan)
    return plan.parts["fresh"]


def _split(plan: AttentionPlan) -> FreshSplit | None:
    fresh = [s for s in range(plan.num_seqs)
             if plan.query_lens[s] == plan.seq_lens[s] and plan.query_lens[s] > 1]
    if not fresh:
        return None
    device = plan.block_tables.device
    starts = [0]
    for q_len in plan.query_lens:
        starts.append(starts[-1] + q_len)
    rows = [list(range(starts[s], starts[s + 1])) for s in range(plan.num_seqs)]
    fresh_set = set(fresh)
    rest = [s for s in range(plan.num_seqs) if s not in fresh_set]
    fresh_rows = [r for s in fresh for r in rows[s]]
    fresh_lens = [plan.query_lens[s] for s in fresh]
    fresh_qsl = torch.tensor([0] + fresh_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    rest_tokens = rest_plan = None
    rest_rows = [r for s in rest for r in rows[s] if plan.query_lens[s]]
    if rest and rest_rows:
        rest_tokens = _on(torch.tensor(rest_rows, dtype=torch.int64), device)
        rest_plan = _sub_plan(plan, rest, device)
    return FreshSplit(fresh, len(fresh) == plan.num_seqs,
                      _on(torch.tensor(fresh_rows, dtype=torch.int64), device), fresh_lens,
                      _on(fresh_qsl, device), rest_tokens, rest_plan)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built index on the device without waiting for the device's queued work."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _sub_plan(plan: AttentionPlan, seqs: list[int], device: torch.device) -> AttentionPlan:
    """The plan of sequences `seqs` alone (already validated as part of `plan`)."""
    idx = _on(torch.tensor(seqs, dtype=torch.int64), device)
    q_lens = [plan.query_lens[s] for s in seqs]
    lens = [plan.seq_lens[s] for s in seqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return AttentionPlan(len(seqs), sum(q_lens), plan.block_size, max(q_lens), max(lens),
                         plan.max_block_id, q_lens, lens, plan.block_tables.index_select(0, idx),
                         plan.seq_lens_t.index_select(0, idx), _on(qsl, device))


def fresh_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    split: FreshSplit, scale: float, out: torch.Tensor) -> None:
    """Causal attention of the fresh sequences over their own new K/V, written into out's rows."""
    if split.all_fresh:
        fq, fk, fv = q, key, value
    else:
        fq, fk, fv = (t.index_select(0, split.fresh_tokens) for t in (q, key, value))
    res = _varlen(fq, fk, fv, split, scale)
    if res is None:
        res = _per_sequence(fq, fk.to(fq.dtype), fv.to(fq.dtype), split, scale)
    if split.all_fresh:
        out.copy_(res)
    else:
        out.index_copy_(0, split.fresh_tokens, res)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: FreshSplit,
            scale: float) -> torch.Tensor | None:
    """FlashAttention's varlen kernel over every fresh sequence at once; None where it does not
    serve this call (CPU tensors, fp32, a torch without it, or one that refused once)."""
    if not q.is_cuda or q.dtype not in _HALF or k.dtype != q.dtype or not _varlen_usable():
        return None
    from torch.nn.attention.varlen import varlen_attn

    try:
        top = max(split.fresh_lens)
        return varlen_attn(q, k, v, split.fresh_qsl, split.fresh_qsl, top, top, scale=scale, window_size=(-1, 0),
                           enable_gqa=q.shape[1] != k.shape[1])
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        _varlen_usable.cache_clear()
        _VARLEN_FAILED.append(repr(exc))
        logger.warning("varlen_attn failed (%s): fresh prefills run one SDPA per sequence", exc)
        return None


_VARLEN_FAILED: list[str] = []


@functools.cache
def _varlen_usable() -> bool:
    if _VARLEN_FAILED:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: FreshSplit,
                  scale: float) -> torch.Tensor:
    """One causal SDPA per fresh sequence on [1, heads, len, d] views, GQA by SDPA's enable_gqa
    (4-D: with 3-D inputs the CPU takes SDPA's math kernel, 5x slower at 1k tokens)."""
    res = torch.empty_like(q)
    start = 0
    gqa = q.shape[1] != k.shape[1]
    for s_len in split.fresh_lens:
        end = start + s_len
        o = F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True,
            scale=scale, enable_gqa=gqa)
        res[start:end] = o[0].transpose(0, 1)
        start = end
    return res


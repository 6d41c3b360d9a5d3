"""paged_attention: one entry point for causal attention over the paged KV cache, any backend."""

from __future__ import annotations

import torch

from kvserve.kernels import fresh_prefill
from kvserve.kernels.backend import resolve_backend
from kvserve.kernels.checks import check_attention, check_layer_options, check_new_kv
from kvserve.kernels.plan import AttentionPlan, plan_attention
from kvserve.kernels.reference import reference_paged_attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, backend: str = "auto", *,
                    plan: AttentionPlan | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] attention output in q's dtype.

    Pass `plan` (from plan_attention over the same block_tables/seq_lens/query_start_loc) to skip
    the per-call validation and precomputation: the engine plans once per step for all layers.

    Per-layer options (every backend honours them; None = off):
    - `sliding_window` W: the token at position p attends to keys p - W + 1 .. p (W keys), as
      HF's sliding-window masks (Mistral, Gemma 2/3 sliding layers, gpt-oss). The cache still
      holds every block; keys before the window are masked, not freed.
    - `logits_soft_cap` c: each score s = scale * q.k becomes c * tanh(s / c) before the causal
      mask and the softmax (Gemma 2's attn_logit_softcapping).
    - `sinks` [num_heads]: a learned logit per head that joins each row's softmax denominator
      and attends to nothing (gpt-oss): the weights over the keys sum to less than 1.

    `key`, `value` [num_tokens, num_kv_heads, head_dim]: this step's new K/V (already written to
    the cache). With them, fresh prefills (no cached prefix) may go through torch's
    FlashAttention on the contiguous K/V instead of the paged kernel (kernels/fresh_prefill.py).
    """
    check_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    k_scale, v_scale, backend)
    if sliding_window is not None or logits_soft_cap is not None or sinks is not None:
        check_layer_options(sliding_window, logits_soft_cap, sinks, q)
    if key is not None or value is not None:
        check_new_kv(key, value, q, k_cache)
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    plan.check_against(q, k_cache)
    chosen = resolve_backend(backend, k_cache.device)
    opts = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap,
            "sinks": sinks}
    has_options = any(v is not None for v in opts.values())
    if fresh_prefill.route(plan, chosen, k_cache.dtype, key is not None, has_options):
        return _with_fresh(q, key, value, k_cache, v_cache, plan, scale, k_scale, v_scale,
                           chosen)
    return _paged(q, k_cache, v_cache, plan, scale, k_scale, v_scale, chosen, opts,
                  block_tables, seq_lens, query_start_loc)


def _with_fresh(q, key, value, k_cache, v_cache, plan, scale, k_scale, v_scale,
                chosen) -> torch.Tensor:
    """Fresh sequences through torch's attention, the others through the paged kernel."""
    split = fresh_prefill.fresh_split(plan)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fresh_prefill.fresh_attention(q, key, value, split, scale, out)
    if split.rest_plan is not None:
        rest = split.rest_plan
        res = _paged(q.index_select(0, split.rest_tokens), k_cache, v_cache, rest, scale,
                     k_scale, v_scale, chosen, {}, rest.block_tables, rest.seq_lens_t,
                     rest.query_start_loc)
        out.index_copy_(0, split.rest_tokens, res)
    return out


def _paged(q, k_cache, v_cache, plan, scale, k_scale, v_scale, chosen, opts, block_tables,
           seq_lens, query_start_loc) -> torch.Tensor:
    """The chosen backend's paged kernel over the whole plan."""
    if chosen == "triton":
        from kvserve.kernels.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, plan, scale, k_scale, v_scale, **opts)
    if chosen == "cpu":
        from kvserve.kernels.cpu_attention import cpu_paged_attention

        return cpu_paged_attention(q, k_cache, v_cache, plan, scale, k_scale, v_scale, **opts)
    if chosen == "torch":
        from kvserve.kernels.torch_attention import torch_paged_attention

        return torch_paged_attention(q, k_cache, v_cache, plan, scale, k_scale, v_scale, **opts)
    return reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, k_scale, v_scale, **opts)

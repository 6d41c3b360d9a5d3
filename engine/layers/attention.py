"""Paged attention as a layer: the kernels' entry points (write K/V through the slot mapping,
attend through the block tables) behind one module per attention layer, which carries the
layer's own options: its sliding window and its attention-logit soft cap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from kvserve.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionOps:
    """The kernels' entry points, looked up on their modules once per model, at its first forward
    (so a test or benchmark that swaps `write_kv` on its module sees what the model writes)."""

    write_kv: Callable
    paged_attention: Callable
    plan_attention: Callable
    rope_write_kv: Callable | None = None

    @classmethod
    def resolve(cls) -> "AttentionOps":
        from kvserve.kernels import attention, plan, write_kv

        return cls(write_kv.write_kv, attention.paged_attention, plan.plan_attention,
                   write_kv.rope_write_kv)

    def prepare(self, attn: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """attn with a plan shared by every layer (the runner usually supplies one already)."""
        if attn.plan is not None:
            return attn
        plan = self.plan_attention(attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                   block_size)
        return replace(attn, plan=plan)

    def write(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
              attn: AttentionMetadata) -> None:
        self.write_kv(k, v, k_cache, v_cache, attn.slot_mapping, attn.k_scale, attn.v_scale,
                      backend=attn.backend)

    def rotate_and_write(self, q: Tensor, k: Tensor, v: Tensor, rope: tuple[Tensor, Tensor],
                         k_cache: Tensor, v_cache: Tensor,
                         attn: AttentionMetadata) -> tuple[Tensor, Tensor | None]:
        """(rotated q, rotated k or None) with rope(k) and v written to the cache. A decode-only
        step on the GPU rotates k inside the KV write (one kernel, no rotated copy of k: None
        is returned, nothing reads it); a step with a prefill keeps the rotated keys, which a
        fresh prompt attends over directly, and so does the CPU (its fused C++ rotary)."""
        from kvserve.kernels import cpu_ops

        if attn.max_query_len == 1 and self.rope_write_kv is not None and \
                self.rope_write_kv(k, v, *rope, k_cache, v_cache, attn.slot_mapping,
                                   attn.k_scale, attn.v_scale, backend=attn.backend):
            return cpu_ops.rotate_queries(q, *rope), None
        q, k = cpu_ops.rotary_embedding(q, k, *rope)
        self.write(k, v, k_cache, v_cache, attn)
        return q, k

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: AttentionMetadata,
               scale: float, new_kv: tuple[Tensor, Tensor] | None = None,
               **layer_options) -> Tensor:
        """`layer_options`: paged_attention's per-layer keywords (sliding_window, ...), passed
        only when set so a plain layer calls the kernels exactly as before. `new_kv`: the
        step's new (rotated) keys and values, passed on a step with a prefill so a fresh prompt
        can attend over them directly (kernels/fresh_prefill.py)."""
        if new_kv is not None and attn.max_query_len > 1:
            layer_options = {**layer_options, "key": new_kv[0], "value": new_kv[1]}
        return self.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                    attn.query_start_loc, scale, attn.k_scale, attn.v_scale,
                                    backend=attn.backend, plan=attn.plan, **layer_options)


class Attention(nn.Module):
    """One layer's attention over the paged cache: q [T, heads, D], k/v [T, kv_heads, D] (rotated
    here when `rope` is passed) are written to the cache, attended, and returned as
    [T, heads * D].

    `sliding_window` W: this layer sees the last W positions only (None: all of them; the cache
    keeps every block either way). `logits_soft_cap` c: scores become c * tanh(score / c).
    `sinks`: a learned logit per head in every softmax's denominator (gpt-oss), loaded with
    load_sinks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, sinks: bool = False,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.options = {k: v for k, v in (("sliding_window", sliding_window),
                                          ("logits_soft_cap", logits_soft_cap)) if v is not None}
        self.sinks = None if not sinks else nn.Parameter(
            torch.zeros(num_heads, dtype=dtype, device=device), requires_grad=False)

    def load_sinks(self, source: Tensor) -> None:
        """This layer's (this rank's heads') sink logits (finite: checked here, once, so the
        step never reads them back from a device)."""
        if not bool(torch.isfinite(source).all()):
            raise ValueError("attention sinks must be finite")
        with torch.no_grad():
            self.sinks.copy_(source)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: tuple[Tensor, Tensor],
                attn: AttentionMetadata, attn_ops: AttentionOps,
                rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`rope` (cos, sin of each token, every dim rotating): q and k come unrotated and are
        rotated here, k in the KV write where the kernels allow (AttentionOps.rotate_and_write);
        None: q and k come rotated."""
        k_cache, v_cache = kv_cache
        if rope is None:
            attn_ops.write(k, v, k_cache, v_cache, attn)
        else:
            q, k = attn_ops.rotate_and_write(q, k, v, rope, k_cache, v_cache, attn)
        options = self.options if self.sinks is None else {**self.options, "sinks": self.sinks}
        new_kv = None if k is None else (k, v)
        out = attn_ops.attend(q, k_cache, v_cache, attn, self.scale, new_kv, **options)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, "
                f"logits_soft_cap={self.logits_soft_cap}")

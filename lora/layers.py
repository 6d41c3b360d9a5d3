"""LoRALinear: a linear (plain, oneDNN-packed or quantised) plus the batched LoRA delta of the
adapters resident in its slots, each row of the batch with its own adapter.

A fused linear (qkv_proj, gate_up_proj) has one output slice per projection it fuses; each
slice has its own A and B per slot. Buffers: A [S, L, R, K] and B^T [S, L, R, N] (N: the
widest slice, zero padded), L = max_loras slots, R = max_lora_rank rounded up to a power of two
(a smaller adapter rank is zero padded). The step's per-row slot index lives in LoRABatch,
shared by every wrapped linear of the model and set once per step (-1: no adapter).

Both devices keep B^T in one layout and read only each row's own adapter: on the CPU one C++
call per linear for the whole batch (kernels/csrc/cpu_lora.cpp: shrink and expand per row, into
the base output in place), on CUDA one Triton shrink and one expand launch (kernels/triton_lora.py).
Dense matmuls over every slot (x @ A_all^T masked per row, then by a block-diagonal B) cost
oneDNN's fixed per-call overhead twice a linear at decode sizes, as much as the base linear
(docs/perf/lora.md); they remain only as the fallback where the C++ build is unavailable
(`lora_delta`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.kernels import cpu_ops as ops


class LoRABatch:
    """The current step's slot per row, shared by every LoRALinear of one model."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.indices: Tensor | None = None  # [T] int64, -1 = base model; None: no adapter rows
        self.dtype = torch.float32
        self._onehot: Tensor | None = None

    def set(self, indices: Tensor | None, dtype: torch.dtype) -> None:
        self.indices, self.dtype, self._onehot = None, dtype, None
        if indices is None:  # the step has no adapter row: the base path only
            return
        self.indices = indices.to(torch.int64).contiguous()

    @property
    def onehot(self) -> Tensor:
        """[T, L] in the model's dtype: 1 at each row's slot (the torch fallback's mask, made
        once a step when a linear first asks)."""
        if self._onehot is None:
            slots = torch.arange(self.num_slots, device=self.indices.device)  # type: ignore[union-attr]
            self._onehot = (self.indices[:, None] == slots[None, :]).to(self.dtype)  # type: ignore[index]
        return self._onehot


class LoRALinear(nn.Module):
    """base(x) + the LoRA delta of each row's adapter; `widths`: this rank's output slices.

    A is [S, L, R, K] and B^T [S, L, R, N] on every device; one kernel call adds the delta of
    every row's adapter into the base output in place."""

    def __init__(self, base: nn.Module, in_features: int, widths: list[int], batch: LoRABatch,
                 rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.batch = base, batch
        self.in_features, self.widths, self.rank = in_features, list(widths), rank
        s, n, slots = len(widths), max(widths), batch.num_slots
        self.offsets_list = [sum(widths[:i]) for i in range(s)]
        self.register_buffer("lora_a", torch.zeros(s, slots, rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.gpu = torch.device(device).type == "cuda"
        self.register_buffer("lora_b", torch.zeros(s, slots, rank, n, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("offsets", torch.tensor(self.offsets_list, dtype=torch.int32,
                                                     device=device), persistent=False)
        self.register_buffer("widths_t", torch.tensor(widths, dtype=torch.int32, device=device),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.batch.indices is None:
            return y
        if self.gpu:
            if not ops.use_triton(y):  # KVSERVE_FUSED_OPS=0: torch on the Triton layout
                return y + lora_delta(x, self.lora_a, self.lora_b, self.batch.onehot,
                                      self.widths).to(y.dtype)
            from kvserve.kernels import triton_lora

            triton_lora.add_lora(y, x, self.lora_a, self.lora_b, self.batch.indices,
                                 self.offsets, self.widths_t)
            return y
        if y.dim() == 2 and y.stride(-1) == 1 and x.dim() == 2 and x.stride(-1) == 1 and \
                x.dtype == y.dtype == self.lora_a.dtype and ops._fused(y):
            torch.ops.kvserve_ops.lora_add(y, x, self.lora_a, self.lora_b, self.batch.indices,
                                           self.offsets_list, self.widths)
            return y
        return y + lora_delta(x, self.lora_a, self.lora_b, self.batch.onehot,
                              self.widths).to(y.dtype)

    @torch.no_grad()
    def set_slot(self, slot: int, slice_index: int, a: Tensor | None, b: Tensor | None) -> None:
        """Slot `slot`, slice `slice_index` := A [r, K], B [width, r] (None: zeros)."""
        self.lora_a[slice_index, slot].zero_()
        self.lora_b[slice_index, slot].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        self.lora_a[slice_index, slot, :r].copy_(a)
        self.lora_b[slice_index, slot, :r, : b.shape[0]].copy_(b.t())


def lora_delta(x: Tensor, a: Tensor, b: Tensor, onehot: Tensor, widths: list[int]) -> Tensor:
    """The torch fallback (no C++ build, or KVSERVE_FUSED_OPS=0 on CUDA): dense over every slot,
    masked per row; [T, K] -> [T, sum widths]."""
    s, l, r, k = a.shape
    t = x.shape[0]
    shrink = (x @ a.view(s * l * r, k).t()).view(t, s, l, r) * onehot[:, None, :, None]
    y = torch.bmm(shrink.view(t, s, l * r).transpose(0, 1), b.view(s, l * r, b.shape[-1]))
    return torch.cat([y[i, :, :w] for i, w in enumerate(widths)], dim=-1)


def lora_delta_reference(x: Tensor, a: Tensor, b: Tensor, indices: Tensor,
                         widths: list[int]) -> Tensor:
    """Row by row (tests only): the definition the batched paths must match."""
    out = torch.zeros(x.shape[0], sum(widths), dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        slot = int(indices[t])
        if slot < 0:
            continue
        off = 0
        for i, w in enumerate(widths):
            out[t, off : off + w] = (x[t].float() @ a[i, slot].float().t()) @ b[i, slot, :, :w].float()
            off += w
    return out

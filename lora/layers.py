"""LoRALinear: a linear (plain, oneDNN-packed or quantised) plus the batched LoRA delta of the
adapters resident in its slots, each row of the batch with its own adapter.

A fused linear (qkv_proj, gate_up_proj) has one output slice per projection it fuses; each
slice has its own A and B per slot. Buffers: A [S, L, R, K] and B^T [S, L, R, N] (N: the
widest slice, zero padded), L = max_loras slots, R = max_lora_rank rounded up to a power of two
(a smaller adapter rank is zero padded). The step's per-row slot index lives in LoRABatch,
shared by every wrapped linear of the model and set once per step (-1: no adapter).

The delta on the CPU is two dense matmuls over every slot: x @ A_all^T masked to each row's
slot, then one addmm by a block-diagonal B into the base output; that costs L * R columns per
slice next to the base linear's N, and no gather of weights per row. On CUDA it is one Triton shrink and one expand launch
(kernels/triton_lora.py) that read only each row's own adapter.
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
        self.onehot: Tensor | None = None  # [T, L] in the model's dtype (the CPU path's mask)
        self._masks: dict[tuple[int, int], Tensor] = {}

    def set(self, indices: Tensor | None, dtype: torch.dtype) -> None:
        self._masks = {}
        self.indices = self.onehot = None
        if indices is None:  # the step has no adapter row: the base path only
            return
        self.indices = indices
        if not ops.use_triton(indices):
            slots = torch.arange(self.num_slots, device=indices.device)
            self.onehot = (indices[:, None] == slots[None, :]).to(dtype)

    def mask(self, slices: int, rank: int) -> Tensor:
        """[T, S * L * R]: 1 where the column belongs to the row's slot (made once a step for
        each (S, R) the model's linears have)."""
        key = (slices, rank)
        m = self._masks.get(key)
        if m is None:
            t, l = self.onehot.shape  # type: ignore[union-attr]
            m = self.onehot[:, None, :, None].expand(t, slices, l, rank).reshape(t, -1)  # type: ignore[index]
            self._masks[key] = m
        return m


class LoRALinear(nn.Module):
    """base(x) + the LoRA delta of each row's adapter; `widths`: this rank's output slices.

    A is [S, L, R, K]. B is kept in the layout its path reads: on CUDA B^T [S, L, R, N] for the
    Triton kernels; on the CPU one block-diagonal [S * L * R, sum of widths] matrix, so the whole
    delta is x @ A_all^T, masked, then one addmm into the base output (three ops a linear)."""

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
        b_shape = (s, slots, rank, n) if self.gpu else (s * slots * rank, sum(widths))
        self.register_buffer("lora_b", torch.zeros(b_shape, dtype=dtype, device=device),
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
        s, slots, r, k = self.lora_a.shape
        shrink = x @ self.lora_a.view(s * slots * r, k).t()
        shrink.mul_(self.batch.mask(s, r))
        if y.dim() == 2 and y.is_contiguous():
            return y.addmm_(shrink, self.lora_b)
        return y + shrink @ self.lora_b

    @torch.no_grad()
    def set_slot(self, slot: int, slice_index: int, a: Tensor | None, b: Tensor | None) -> None:
        """Slot `slot`, slice `slice_index` := A [r, K], B [width, r] (None: zeros)."""
        self.lora_a[slice_index, slot].zero_()
        rows, cols = self._b_block(slot, slice_index)
        rows.zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        self.lora_a[slice_index, slot, :r].copy_(a)
        if self.gpu:
            rows[:r, : b.shape[0]].copy_(b.t())
        else:
            cols[:r].copy_(b.t())

    def _b_block(self, slot: int, i: int) -> tuple[Tensor, Tensor]:
        """(the part of lora_b to zero, the [R, width] block this slice's B^T goes into)."""
        if self.gpu:
            block = self.lora_b[i, slot]
            return block, block
        start = (i * self.batch.num_slots + slot) * self.rank
        rows = self.lora_b[start : start + self.rank]
        off = self.offsets_list[i]
        return rows, rows[:, off : off + self.widths[i]]


def lora_delta(x: Tensor, a: Tensor, b: Tensor, onehot: Tensor, widths: list[int]) -> Tensor:
    """The CPU path's arithmetic on the Triton layout (B^T [S, L, R, N]), for tests: [T, K] ->
    [T, sum widths]."""
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

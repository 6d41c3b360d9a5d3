"""The MoE experts on a GPU: the fused Triton kernel (kernels/triton_moe.py) over every expert at
once, nothing read back to the host (so a step with MoE layers is CUDA-graph capturable).

Dense experts are read in place from FusedMoE's stacked [E, N, K] parameters. Quantised experts
(one QuantLinear per expert after loading) are stacked once, at load, into `StackedExperts`:
every expert's codes, scales and offsets in the kernel's layout, one tensor each. Activation-
quantised schemes (W8A8 int8, FP8 with per-token activations) quantise the input per token with
torch first, as the per-expert kernels do; the kernel reads the codes and applies the row scale
after its K loop. A static input scale is one per layer: the largest of the experts' (as vLLM).
"""

from __future__ import annotations

import os

import torch
from kvserve.engine.layers.quantization.activation import (
    ActivationScheme,
    fp8_per_token,
    torch_int8_per_token,
)
from kvserve.engine.layers.quantization.qweight import QuantizedWeight
from kvserve.kernels import cpu_ops as ops
from torch import Tensor, nn


def stack_on(device: torch.device) -> bool:
    """Whether quantised experts loaded onto `device` are stacked for the fused kernel (and not
    kept as one kernel per expert): CUDA, unless KVSERVE_FUSED_OPS=0 (read once, at load)."""
    return device.type == "cuda" and os.environ.get("KVSERVE_FUSED_OPS", "1") != "0"


def stackable(ws: list[QuantizedWeight], device: torch.device) -> bool:
    """Whether the fused kernel can read these experts on `device`: Triton has no float8_e4m3fn
    before compute capability 8.9 (there FP8 experts keep one dequantising kernel each)."""
    if not ws[0].is_float or device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


class StackedExperts(nn.Module):
    """One projection of every quantised expert in the fused kernel's layout (buffers, so they
    move and are counted with the model)."""

    def __init__(self, ws: list[QuantizedWeight], activation: ActivationScheme | None) -> None:
        super().__init__()
        from kvserve.kernels.triton_moe import pack_int4

        first = ws[0]
        if any(w.is_float != first.is_float or w.bits != first.bits
               or (w.zero is None) != (first.zero is None) for w in ws):
            raise ValueError("the experts of one projection are quantised differently")
        self.fmt = "fp8" if first.is_float else f"int{first.bits}"
        if self.fmt not in ("fp8", "int4", "int8"):
            raise ValueError(f"no fused MoE kernel for {first.bits}-bit experts")
        self.n, self.k, self.activation = first.out_features, first.in_features, activation
        statics = [w.input_scale for w in ws if w.input_scale is not None]
        self.input_scale = max(statics) if activation and activation.static and statics else None
        same_groups = len({(w.group_size, w.scale.shape[1]) for w in ws}) == 1
        self.group = first.group_size if same_groups and all(w.g_idx is None for w in ws) else 0
        groups = max(w.scale.shape[1] for w in ws)
        codes, scales, offsets = [], [], []
        for w in ws:
            scale = _pad_groups(w.scale.float(), groups)
            zero = None if w.zero is None else _pad_groups(w.zero.float(), groups)
            if self.fmt == "int4":  # unsigned u = v + 8: w = u * s - (8 + z) * s
                codes.append(pack_int4(w.values.to(torch.int16) + 8))
                offsets.append(-((8 if zero is None else zero + 8) * scale))
            else:
                codes.append(w.values.t().contiguous())
                if zero is not None:
                    offsets.append(-zero * scale)
            scales.append(scale)
        self.register_buffer("codes", torch.stack(codes), persistent=False)
        self.register_buffer("scale", torch.stack(scales).transpose(1, 2).contiguous(),
                             persistent=False)
        self.register_buffer("offset", torch.stack(offsets).transpose(1, 2).contiguous()
                             if offsets else None, persistent=False)
        self.register_buffer("g_idx", None if self.group else torch.stack(
            [w.group_of_column().to(torch.int32) for w in ws]), persistent=False)

    def weights(self):
        from kvserve.kernels.triton_moe import ExpertWeights

        return ExpertWeights(self.fmt, self.codes, self.n, self.k, self.scale, self.offset,
                             self.group, self.g_idx)

    def quantise_input(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """(the kernel's input, its fp32 row scales or None): x itself for weight-only schemes."""
        act = self.activation
        if act is None:
            return x, None
        if act.kind == "int8":
            codes, scale = torch_int8_per_token(x, self.input_scale)
            return codes, scale.reshape(-1)
        codes, scale = fp8_per_token(x, self.input_scale)
        return codes, scale.reshape(-1)

    def extra_repr(self) -> str:
        act = f", activations {self.activation.kind}" if self.activation else ""
        return f"{self.codes.shape[0]} experts, {self.k} -> {self.n}, {self.fmt}{act}"


def _pad_groups(t: Tensor, groups: int) -> Tensor:
    """[out, g] -> [out, groups] (experts cut differently keep their own g_idx into it)."""
    return t if t.shape[1] == groups else torch.cat(
        (t, t.new_zeros(t.shape[0], groups - t.shape[1])), dim=1)


def dense_weights(w: Tensor):
    """FusedMoE's stacked dense parameter [E, N, K] as the kernel reads it (no copy)."""
    from kvserve.kernels.triton_moe import ExpertWeights

    return ExpertWeights("dense", w, w.shape[1], w.shape[2])


def gpu_experts(x: Tensor, w13: Tensor | StackedExperts, w2: Tensor | StackedExperts,
                weights: Tensor, ids: Tensor, spec, b13: Tensor | None = None,
                b2: Tensor | None = None) -> Tensor:
    """fused_experts' result (sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), [T, H] in x's
    dtype) through two launches of the fused kernel and one activation."""
    from kvserve.kernels import triton_moe as tm

    t, k = ids.shape
    if t == 0:
        return x.new_zeros(0, spec.hidden)
    pairs = t * k
    tiles = tm.choose_tiles(pairs, spec.num_experts)
    sorted_pairs, block_expert, _ = tm.align_block_size(ids, spec.num_experts, tiles.block_m)
    quant = isinstance(w13, StackedExperts)
    a, a_scale = w13.quantise_input(x) if quant else (x, None)
    h = tm.moe_matmul(a, w13.weights() if quant else dense_weights(w13), sorted_pairs,
                      block_expert, pairs, k, x.dtype, tiles, a_scale, b13)
    h = _activation(h, spec)
    a, a_scale = w2.quantise_input(h) if quant else (h, None)
    y = tm.moe_matmul(a, w2.weights() if quant else dense_weights(w2), sorted_pairs,
                      block_expert, pairs, 1, x.dtype, tiles, a_scale, b2,
                      weights.reshape(-1).float())
    return y.view(t, k, -1).sum(dim=1)


def _activation(h: Tensor, spec) -> Tensor:
    if spec.activation == "silu":
        if ops.use_triton(h):
            from kvserve.kernels import triton_fused

            return triton_fused.act_and_mul(h, "silu")
        return ops.torch_silu_and_mul(h)
    return ops.swiglu_clamped(h, spec.swiglu_alpha, spec.swiglu_limit)

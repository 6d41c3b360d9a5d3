"""oneDNN-prepacked linears for the CPU: the weights are reordered once into the blocked layout
oneDNN's matmul wants, instead of on every call.

`F.linear` on a CPU tensor hands oneDNN (or MKL) a plain row-major weight, which is reordered
internally on every call, so a step pays the reorder once per linear of every layer. Packing
once (the same `torch.ops.mkldnn` ops inductor's freezing pass emits) takes that out of every
step; the gain per layer and for the lm_head is in docs/perf.md. Outputs equal F.linear's up to
float rounding; `pack_linears` checks that on a probe input and keeps F.linear where it is not so.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger("kvserve.engine")


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (CPU, fp32 or bf16)."""

    def __init__(self, packed: Tensor, bias: Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def _pack(linear: nn.Linear) -> PackedLinear:
    weight = linear.weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    bias = linear.bias.detach() if linear.bias is not None else None
    module = PackedLinear(packed, bias, linear.in_features, linear.out_features)
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.dtype)
    expected = F.linear(probe, weight, bias).float()
    got = module(probe).float()
    tol = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
    if not torch.allclose(got, expected, rtol=tol, atol=tol * float(expected.abs().max())):
        raise RuntimeError("packed output differs from F.linear")
    return module


def pack_linears(model: nn.Module, pack_tied: bool = True) -> int:
    """Replace every nn.Linear of a CPU fp32/bf16 model by a PackedLinear; returns how many.

    Tied weights (an lm_head sharing the embedding) are packed as a copy: the embedding keeps
    the plain weight for its lookups. `pack_tied=False` leaves them unpacked (one copy: what a
    quantised model, whose point is memory, wants). Nothing is changed when oneDNN cannot pack.
    """
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not torch.backends.mkldnn.is_available():
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    if not pack_tied:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
                      or type(m).__name__ == "VocabParallelEmbedding"}
        targets = [t for t in targets if id(t[2].weight) not in embeddings]
    if not targets or targets[0][2].weight.device.type != "cpu" or \
            targets[0][2].weight.dtype not in (torch.float32, torch.bfloat16):
        return 0
    try:
        with torch.no_grad():
            packed = [(parent, name, _pack(child)) for parent, name, child in targets]
    except Exception as exc:  # noqa: BLE001 - keep F.linear: correct, only slower
        logger.warning("oneDNN weight prepacking unavailable (%s); using plain linears", exc)
        return 0
    for parent, name, module in packed:
        setattr(parent, name, module)
    return len(packed)

"""The fused mixture-of-experts layer: top-k routing, then every expert's tokens as one
contiguous segment through two grouped matmuls over experts stored stacked ([E, ...] tensors),
plus the optional shared expert with its sigmoid gate (Qwen2-MoE).

The batch is never walked per token: the T x k (token, expert) pairs are sorted by expert id
(one argsort), so each expert's rows are one contiguous segment, and `F.grouped_mm` multiplies
all segments in one call (one mm per non-empty segment where grouped_mm does not serve the
device/dtype). Quantised experts (a compressed-tensors checkpoint, or --quantization int8|fp8) are
one QuantLinear per expert and projection, their weights kept quantised: each expert's segment goes
through its own quantised kernel, the same loop over experts as segment_mm's fallback. These
paths read the per-expert counts on the host: they are the CPU's. On a CUDA device (unless
KVSERVE_FUSED_OPS=0) the experts, dense or quantised, run through the fused Triton kernel of
moe_gpu.py instead, which reads nothing back (quantised experts are stacked for it at load,
`finish_experts`). The router
stays dense (as vLLM and llm-compressor's `ignore` of `mlp.gate` keep it). Under tensor parallelism each rank holds its slice of every expert's intermediate
dimension (gate/up by output rows, down by input columns, as the dense MLP), so the layer's
output is a partial sum: one all-reduce after the routed and shared experts together.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.engine.errors import ConfigError, ModelNotFoundError
from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.linear import RankSlice, skip_init_linear
from kvserve.engine.layers.mlp import GatedMLP
from kvserve.engine.layers.moe_gpu import StackedExperts, gpu_experts, stack_on, stackable
from kvserve.kernels import cpu_ops as ops

if TYPE_CHECKING:
    from kvserve.engine.distributed import TPGroup

ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer's shape and arithmetic, read from the HF config by the model family."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # per expert, whole (every rank holds intermediate / tp_size of it)
    renormalize: bool  # weights of the top k sum to 1 (norm_topk_prob; gpt-oss always)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # "silu": silu(gate) * up; "swiglu_clamped": gpt-oss's
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate: int = 0  # 0: no shared expert


def route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E].

    The k largest logits are the k largest softmax probabilities, so top-k runs on the logits;
    a weight is softmax(all)[id], or softmax over the chosen k when renormalised (the same
    as HF's softmax -> topk -> divide by the sum, and as gpt-oss's topk -> softmax).
    """
    logits = logits.float()
    top, ids = logits.topk(top_k, dim=-1)
    if renormalize:
        return top.softmax(dim=-1), ids
    return (top - logits.logsumexp(dim=-1, keepdim=True)).exp(), ids


@functools.cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's F.grouped_mm serves (device, dtype): probed once on a tiny case."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        a = torch.ones(3, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        out = F.grouped_mm(a, b, offs=torch.tensor([1, 3], dtype=torch.int32, device=device_type))
        return bool(torch.all(out == 16))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _strides_aligned(t: Tensor) -> bool:
    """grouped_mm's rule: every stride but the unit one a multiple of 16 bytes (a bf16 expert
    slice 12 wide under tensor parallelism is not)."""
    return all(s == 1 or s * t.element_size() % 16 == 0 for s in t.stride())


def segment_mm(a: Tensor, b: Tensor, ends: Tensor) -> Tensor:
    """Rows ends[e-1]:ends[e] of a [M, K] times b[e] [K, N], for every expert e -> [M, N]."""
    if _grouped_mm_works(a.device.type, a.dtype) and _strides_aligned(a) and _strides_aligned(b):
        return F.grouped_mm(a, b, offs=ends)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # one mm per expert, not per token
        if end > start:
            torch.mm(a[start:end], b[e], out=out[start:end])
        start = end
    return out


class ExpertLinears(nn.ModuleList):
    """One projection (gate|up fused, or down) of every routed expert as a quantised linear per
    expert (QuantLinear); `segments` runs each expert's rows of the expert-sorted batch through
    its own kernel."""

    def __init__(self, linears: list[nn.Module], out_features: int) -> None:
        super().__init__(linears)
        self.out_features = out_features

    def segments(self, a: Tensor, ends: Tensor) -> Tensor:
        """Rows ends[e-1]:ends[e] of a through expert e's linear -> [M, out_features]."""
        out = a.new_empty(a.shape[0], self.out_features)
        start = 0
        for e, end in enumerate(ends.tolist()):  # one call per expert, not per token
            if end > start:
                out[start:end] = self[e](a[start:end])
            start = end
        return out


def _experts_mm(a: Tensor, w: "Tensor | ExpertLinears", ends: Tensor) -> Tensor:
    if isinstance(w, ExpertLinears):
        return w.segments(a, ends)
    return segment_mm(a, w.transpose(1, 2), ends)


def fused_experts(x: Tensor, w13: "Tensor | ExpertLinears", w2: "Tensor | ExpertLinears",
                  weights: Tensor, ids: Tensor,
                  spec: MoESpec, b13: Tensor | None = None,
                  b2: Tensor | None = None) -> Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H] -> [T, H] in x's dtype.

    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], b13 [E, 2I], b2 [E, H]: the stacked
    layout of nn.Linear weights, transposed (a view) for the grouped matmuls; or quantised, one
    linear per expert (ExpertLinears).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert, tokens in order inside
    experts = flat.index_select(0, order)
    ends = torch.bincount(flat, minlength=spec.num_experts).cumsum(0).to(torch.int32)
    h = _experts_mm(x.index_select(0, order // k), w13, ends)
    if b13 is not None:
        h += b13.index_select(0, experts)
    if spec.activation == "silu":
        h = ops.silu_and_mul(h)
    else:
        h = ops.swiglu_clamped(h, spec.swiglu_alpha, spec.swiglu_limit)
    y = _experts_mm(h, w2, ends)
    if b2 is not None:
        y += b2.index_select(0, experts)
    y *= weights.reshape(-1).index_select(0, order).to(y.dtype).unsqueeze(1)
    unsorted = torch.empty_like(y).index_copy_(0, order, y)
    return unsorted.view(t, k, -1).sum(dim=1)


def _empty(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    # no init: load_weights overwrites every entry (a bias a rank does not own is zeroed there)
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class FusedMoE(nn.Module):
    """Router, stacked experts and optional gated shared expert of one decoder layer.

    Parameters hold this rank's slice: w13 [E, 2 * I/n, H] (gate rows, then up rows),
    w2 [E, H, I/n]; the router (`gate`) and the shared expert's gate are whole on every rank.
    With quantised experts (`quantize_experts`), w13 and w2 are ExpertLinears instead.
    """

    dense_linears = ("gate", "shared_expert_gate")  # never quantised: the routing stays exact

    def __init__(self, spec: MoESpec, tp: "TPGroup | None", dtype: torch.dtype,
                 device=None) -> None:
        super().__init__()
        if spec.activation not in ACTIVATIONS:
            raise ValueError(f"activation {spec.activation!r}: expected one of {ACTIVATIONS}")
        size = tp.size if tp is not None else 1
        for what, n in (("expert intermediate size", spec.intermediate),
                        ("shared expert intermediate size", spec.shared_intermediate)):
            if n % size:
                raise ConfigError(f"tensor_parallel_size={size} does not divide the {what} {n}")
        device = device if device is not None else "cpu"  # skip_init's None would mean "meta"
        self.spec, self.tp = spec, tp
        self.local_intermediate = spec.intermediate // size
        e, h, i = spec.num_experts, spec.hidden, self.local_intermediate
        self.gate = skip_init_linear(h, e, spec.router_bias, dtype, device)
        self.w13 = _empty(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = _empty(e, h, i, dtype=dtype, device=device)
        self.b13 = _empty(e, 2 * i, dtype=dtype, device=device) if spec.expert_bias else None
        self.b2 = _empty(e, h, dtype=dtype, device=device) if spec.expert_bias else None
        self.w13_stacked: StackedExperts | None = None  # quantised experts on a GPU
        self.w2_stacked: StackedExperts | None = None
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_intermediate:  # tp=None: its partial sum joins the experts' all-reduce
            self.shared_expert = GatedMLP(h, spec.shared_intermediate // size, False, None,
                                          dtype, device)
            self.shared_expert_gate = skip_init_linear(h, 1, False, dtype, device)

    @property
    def quantized(self) -> bool:
        return isinstance(self.w13, ExpertLinears)

    def quantize_experts(self, w13: list[nn.Module], w2: list[nn.Module]) -> None:
        """Replace the stacked dense experts by quantised linears, one per expert: `w13[e]` of
        [2 * I/n, H] (gate shard 0, up shard 1), `w2[e]` of [H, I/n] (QuantLinears, before
        loading; the checkpoint's tensors reach them through load_expert)."""
        if self.spec.expert_bias:
            raise QuantizationError("quantised experts with biases (gpt-oss) are not supported")
        del self.w13, self.w2
        self.w13 = ExpertLinears(w13, 2 * self.local_intermediate)
        self.w2 = ExpertLinears(w2, self.spec.hidden)

    def finish_experts(self, device: torch.device) -> list[nn.Module]:
        """After loading: quantised experts' weights decoded, then stacked for the fused GPU
        kernel (one copy: their per-expert kernels are not built) where `stack_on(device)`, else
        one kernel each. Returns the QuantLinears it finished."""
        if not self.quantized:
            return []
        linears = [*self.w13, *self.w2]
        if not stack_on(device):
            for linear in linears:
                linear.finish(device)
            return linears
        w13 = [lin.decode(device) for lin in self.w13]
        w2 = [lin.decode(device) for lin in self.w2]
        if stackable(w13 + w2, device):
            self.stack_experts(w13, w2)
        else:
            for linear, w in zip(linears, w13 + w2, strict=True):
                linear.finish(device, w)
        return linears

    def stack_experts(self, w13: list, w2: list) -> None:
        """Quantised experts as the fused kernel reads them, from each expert's QuantizedWeight
        (gate | up [2 * I/n, H], down [H, I/n]); from then on the fused path serves them."""
        act = self.w13[0].method.activation
        self.w13_stacked = StackedExperts(w13, act)
        self.w2_stacked = StackedExperts(w2, act)

    def _fused_gpu(self, x: Tensor) -> bool:
        """Whether the fused Triton kernel serves this call: quantised experts once stacked
        (their only form then), dense ones for CUDA tensors (the switch of the other GPU ops)."""
        if self.quantized:
            return self.w13_stacked is not None
        return ops.use_triton(x) and x.dim() == 2

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> [T, hidden], summed over the ranks."""
        weights, ids = route(self.gate(x), self.spec.top_k, self.spec.renormalize)
        if self._fused_gpu(x):
            out = gpu_experts(x, self.w13_stacked if self.quantized else self.w13,
                              self.w2_stacked if self.quantized else self.w2, weights, ids,
                              self.spec, self.b13, self.b2)
        else:
            out = fused_experts(x, self.w13, self.w2, weights, ids, self.spec, self.b13,
                                self.b2)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out += gate * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    # ---- loading: HF tensors (or lazy safetensors slices) into this rank's stacked slices ----
    def _rank_cols(self) -> tuple[int, int]:
        """(start, length) of this rank's slice of the intermediate dimension."""
        rank = self.tp.rank if self.tp is not None else 0
        return rank * self.local_intermediate, self.local_intermediate

    def load_expert(self, expert: int, proj: str, source, name: str,
                    leaf: str = "weight") -> None:
        """One expert's nn.Linear weight as HF stores it per expert: proj "gate" or "up"
        [I, H], "down" [H, I] (Mixtral's w1 / w3 / w2). Quantised experts take every leaf of
        their format (weight_packed, weight_scale, ...); this rank's rows (gate / up) or columns
        (down) are cut after decoding, so scales and zero points follow them."""
        spec, (start, n) = self.spec, self._rank_cols()
        if not 0 <= expert < spec.num_experts:
            raise ModelNotFoundError(f"checkpoint tensor {name!r}: expert {expert} is past the "
                                     f"config's {spec.num_experts} experts")
        if self.quantized:
            linears = self.w2 if proj == "down" else self.w13
            shard = None if proj == "down" else (0 if proj == "gate" else 1)
            cut = None if self.tp is None else RankSlice(1 if proj == "down" else 0, start, n)
            linears[expert].take(leaf, shard, source, cut)
            return
        if leaf != "weight":
            raise QuantizationError(
                f"checkpoint tensor {name!r} is a quantised expert's, but config.json's "
                "quantization_config does not quantise this layer's experts")
        full = (spec.hidden, spec.intermediate) if proj == "down" else (spec.intermediate,
                                                                        spec.hidden)
        _check_shape(name, source, full)
        with torch.no_grad():
            if proj == "down":
                self.w2[expert].copy_(source.narrow(1, start, n))
            else:
                rows = self.w13[expert].narrow(0, 0 if proj == "gate" else n, n)
                rows.copy_(source.narrow(0, start, n))

    def load_shared(self, proj: str, source, name: str, leaf: str = "weight") -> None:
        """The shared expert's HF weight: proj "gate" or "up" [Is, H], "down" [H, Is] (or, its
        linears quantised, any leaf of their format)."""
        spec, size = self.spec, self.tp.size if self.tp is not None else 1
        n = spec.shared_intermediate // size
        start = (self.tp.rank if self.tp is not None else 0) * n
        linear = self.shared_expert.down_proj if proj == "down" else \
            self.shared_expert.gate_up_proj
        if hasattr(linear, "take"):  # a QuantLinear
            cut = None if self.tp is None else RankSlice(1 if proj == "down" else 0, start, n)
            linear.take(leaf, None if proj == "down" else (0 if proj == "gate" else 1), source,
                        cut)
            return
        if leaf != "weight":
            raise QuantizationError(
                f"checkpoint tensor {name!r} is quantised, but config.json's quantization_config "
                "does not quantise the shared expert")
        full = (spec.hidden, spec.shared_intermediate) if proj == "down" else \
            (spec.shared_intermediate, spec.hidden)
        _check_shape(name, source, full)
        with torch.no_grad():
            if proj == "down":
                self.shared_expert.down_proj.weight.copy_(source.narrow(1, start, n))
            else:
                gate_up = self.shared_expert.gate_up_proj.weight
                gate_up.narrow(0, 0 if proj == "gate" else n, n).copy_(source.narrow(0, start, n))

    def load_stacked(self, leaf: str, source, name: str) -> None:
        """gpt-oss's stacked expert tensors: gate_up_proj [E, H, 2I] (gate and up columns
        interleaved), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]."""
        spec, (start, n) = self.spec, self._rank_cols()
        e, h, i = spec.num_experts, spec.hidden, spec.intermediate
        full = {"gate_up_proj": (e, h, 2 * i), "gate_up_proj_bias": (e, 2 * i),
                "down_proj": (e, i, h), "down_proj_bias": (e, h)}[leaf]
        _check_shape(name, source, full)
        with torch.no_grad():
            if leaf == "down_proj":
                self.w2.copy_(source.narrow(1, start, n).transpose(1, 2))
            elif leaf == "down_proj_bias":  # added once, by rank 0, to the partial sums
                if start == 0:
                    self.b2.copy_(source.narrow(0, 0, e))
                else:
                    self.b2.zero_()
            else:  # columns 2j (gate j) and 2j + 1 (up j): this rank's j lie in one range
                part = source.narrow(2 if leaf == "gate_up_proj" else 1, 2 * start, 2 * n)
                part = torch.cat((part[..., 0::2], part[..., 1::2]), dim=-1)
                target = self.w13 if leaf == "gate_up_proj" else self.b13
                target.copy_(part.transpose(1, 2) if leaf == "gate_up_proj" else part)


def _check_shape(name: str, source, expected: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise ModelNotFoundError(
            f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, the model expects "
            f"{tuple(expected)}: config.json does not match the weights")

"""QuantLinear: a linear whose weight a LinearMethod owns. It collects its projections'
checkpoint tensors while the model loads, then repacks them once into the method's kernel."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.linear import PACKED_MODULES
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig
from kvserve.engine.layers.quantization.qweight import QuantizedWeight, concat_rows


class QuantLinear(nn.Module):
    """y = x W^T + b with W quantised. `hf_names`: the checkpoint projections fused here (one
    for a plain linear); each keeps its own scales, stacked along the output dim."""

    def __init__(self, method: LinearMethod, hf_names: list[str], in_features: int,
                 out_features: int, bias: nn.Parameter | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.method, self.hf_names, self.dtype = method, hf_names, dtype
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self._pending: list[dict[str, Tensor]] = [{} for _ in hf_names]
        self._slices: list[object] = [None] * len(hf_names)
        self.kernel: nn.Module | None = None

    def take(self, leaf: str, shard: int | None, source, rank_slice=None) -> None:
        """One checkpoint tensor `<proj>.<leaf>` of shard `shard`; `rank_slice`: the rows or
        columns of the dense weight this tensor-parallel rank keeps (applied after decoding, so
        scales, zero points and g_idx follow their rows or groups)."""
        index = shard or 0
        if leaf not in self.method.leaves:
            raise QuantizationError(
                f"checkpoint tensor {self.hf_names[index]}.{leaf} has no place in "
                f"{self.method.description}; it takes {sorted(self.method.leaves)}")
        self._pending[index][leaf] = _materialise(source)
        self._slices[index] = rank_slice

    def finish(self, device: torch.device, decoded: QuantizedWeight | None = None) -> None:
        """Decode every shard, slice it for this rank, fuse, repack into the kernel (from
        `decoded`, this linear's `decode` result, when it was taken already)."""
        w = decoded if decoded is not None else self.decode(device)
        self.kernel = self.method.kernel(w, self.dtype)

    def decode(self, device: torch.device) -> QuantizedWeight:
        """The fused weight of every shard, sliced for this rank, on `device`; the checkpoint's
        tensors are released (finish builds the kernel from it; an MoE layer stacks its
        experts' instead, engine/layers/moe_gpu.py)."""
        parts: list[QuantizedWeight] = []
        for name, tensors, sl in zip(self.hf_names, self._pending, self._slices, strict=True):
            missing = sorted(self.method.required - tensors.keys())
            if missing:
                raise QuantizationError(
                    f"the checkpoint lacks {name}.{missing[0]} ({self.method.description} needs "
                    f"{sorted(self.method.required)})")
            w = self.method.read(tensors, name)
            parts.append(w if sl is None else w.narrow(sl.dim, sl.start, sl.length))
        w = concat_rows(parts, self.hf_names[0])
        if (w.out_features, w.in_features) != (self.out_features, self.in_features):
            raise QuantizationError(
                f"{' + '.join(self.hf_names)} decode to a [{w.out_features}, {w.in_features}] "
                f"weight, the model expects [{self.out_features}, {self.in_features}]: config.json "
                "does not match the weights")
        self._pending = []
        return _to(w, device)

    def forward(self, x: Tensor) -> Tensor:
        y = self.kernel(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.method.description}"


def _materialise(source) -> Tensor:
    if isinstance(source, Tensor):
        return source
    return source.full()  # a lazy safetensors entry (tensor parallel loading)


def _to(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if w.values.device == device:
        return w
    from dataclasses import replace

    move = (lambda t: None if t is None else t.to(device))  # noqa: E731
    return replace(w, values=move(w.values), scale=move(w.scale), zero=move(w.zero),
                   g_idx=move(w.g_idx))


def quantize_linears(model: nn.Module, config: QuantConfig, dtype: torch.dtype) -> int:
    """Replace each nn.Linear the config quantises by a QuantLinear (before loading); returns
    how many. A tied lm_head stays dense: it is the embedding. A mixture-of-experts layer's
    routed experts become one QuantLinear per expert and projection; its router stays dense.
    The config is asked with the checkpoint's module names (the model's
    `checkpoint_module_name`, e.g. Mixtral's block_sparse_moe.experts.N.w1)."""
    packed = getattr(model, "packed_modules_mapping", PACKED_MODULES)
    ckpt = getattr(model, "checkpoint_module_name", None) or (lambda name: name)
    tied = _tied_weights(model)
    count = 0
    for parent_name, parent in list(model.named_modules()):
        head = f"{parent_name}." if parent_name else ""
        if hasattr(parent, "quantize_experts") and not getattr(model, "stacked_experts", False):
            count += _quantize_experts(parent, head, config, ckpt, dtype)
        keep_dense = getattr(parent, "dense_linears", ())
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child_name in keep_dense:
                continue
            hf_names = [ckpt(head + p) for p in packed.get(child_name, (child_name,))]
            method = _one_method(config, hf_names)
            if method is None or id(child.weight) in tied:
                continue
            if child_name == "lm_head":
                raise QuantizationError(
                    f"a quantised lm_head ({method.description}) is not supported; quantise "
                    "the checkpoint with lm_head in its ignore list")
            setattr(parent, child_name, QuantLinear(method, hf_names, child.in_features,
                                                    child.out_features, child.bias, dtype))
            count += 1
    return count


def _quantize_experts(moe: nn.Module, head: str, config: QuantConfig, ckpt,
                      dtype: torch.dtype) -> int:
    """The routed experts of FusedMoE `moe` as QuantLinears when the config quantises them
    (all of a layer's experts, or none); returns how many linears."""
    spec, local = moe.spec, moe.local_intermediate

    def names(e: int, projs: tuple[str, ...]) -> list[str]:
        return [ckpt(f"{head}experts.{e}.{p}") for p in projs]

    gate_up = [names(e, ("gate_proj", "up_proj")) for e in range(spec.num_experts)]
    down = [names(e, ("down_proj",)) for e in range(spec.num_experts)]
    methods = [_one_method(config, n) for n in gate_up + down]
    if all(m is None for m in methods):
        return 0
    dense = [n[0] for n, m in zip(gate_up + down, methods, strict=True) if m is None]
    if dense:
        raise QuantizationError(
            f"{head}experts: the checkpoint quantises some experts' projections and not others "
            f"(e.g. {dense[0]} is dense); a layer's experts are served all quantised or all dense")
    e = spec.num_experts
    moe.quantize_experts(
        [QuantLinear(m, n, spec.hidden, 2 * local, None, dtype)
         for m, n in zip(methods[:e], gate_up, strict=True)],
        [QuantLinear(m, n, local, spec.hidden, None, dtype)
         for m, n in zip(methods[e:], down, strict=True)])
    return 2 * e


def _one_method(config: QuantConfig, hf_names: list[str]) -> LinearMethod | None:
    methods = [config.method_for(n) for n in hf_names]
    if any(m != methods[0] for m in methods[1:]):
        raise QuantizationError(
            f"{', '.join(hf_names)} are fused into one linear but quantised differently "
            f"({', '.join(str(m and m.description) for m in methods)})")
    return methods[0]


def _tied_weights(model: nn.Module) -> set[int]:
    """ids of linear weights that are also an embedding's (tie_word_embeddings)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} | \
        {id(getattr(m, "weight", None)) for m in model.modules()
         if type(m).__name__ == "VocabParallelEmbedding"}


def finish_quantized(model: nn.Module, device: torch.device) -> list[QuantLinear]:
    """Repack every QuantLinear after loading; returns them. An MoE layer finishes its own
    experts' (FusedMoE.finish_experts: stacked for the fused GPU kernel, or one kernel each)."""
    owned: set[int] = set()
    for module in model.modules():
        if hasattr(module, "finish_experts"):
            owned.update(id(m) for m in module.finish_experts(device))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for linear in linears:
        if id(linear) not in owned:
            linear.finish(device)
    return linears

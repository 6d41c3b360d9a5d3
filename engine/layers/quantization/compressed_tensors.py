"""compressed-tensors checkpoints (llm-compressor's output): `pack-quantized` W4A16 / W8A16,
`int-quantized` W8A8 int8, `float-quantized` FP8, with their config groups and ignore lists."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization.activation import ActivationScheme
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig
from kvserve.engine.layers.quantization.qweight import QuantizedWeight, check_shape, \
    scale_per_row, unpack_int32

SUPPORTED = ("pack-quantized (W4A16, W8A16: int weights, groups or channels, symmetric or not, "
             "optional g_idx), int-quantized / naive-quantized (W8A8 int8, W8A16), "
             "float-quantized (FP8 weights per tensor, channel or block; FP8 or no activations)")


def _input_scale(tensors: dict[str, Tensor], static: bool) -> float | None:
    return float(tensors["input_scale"].float().max()) if static else None


@dataclass(frozen=True)
class PackedInt(LinearMethod):
    """pack-quantized: codes + 2^(bits-1) packed eight (4-bit) or four (8-bit) to an int32 along
    the input dim; asymmetric zero points packed the same way along the OUTPUT dim."""

    bits: int = 4
    group_size: int | None = None
    symmetric: bool = True

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                          "weight_g_idx"})

    @property
    def required(self) -> frozenset[str]:
        base = {"weight_packed", "weight_scale", "weight_shape"}
        return frozenset(base if self.symmetric else base | {"weight_zero_point"})

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        out, cols = (int(v) for v in tensors["weight_shape"].tolist())
        offset = 1 << (self.bits - 1)
        codes = unpack_int32(tensors["weight_packed"], self.bits, cols, dim=1)
        check_shape(f"{name}.weight_packed", codes, (out, cols))
        scale, group = scale_per_row(f"{name}.weight_scale", tensors["weight_scale"], out, cols,
                                     self.group_size)
        zero = None
        if not self.symmetric:
            zero = unpack_int32(tensors["weight_zero_point"], self.bits, out, dim=0) - offset
            check_shape(f"{name}.weight_zero_point", zero, tuple(scale.shape))
            zero = zero.to(torch.int8)
        g_idx = tensors.get("weight_g_idx")
        if g_idx is not None:
            check_shape(f"{name}.weight_g_idx", g_idx, (cols,))
            g_idx = g_idx.to(torch.int32)
        return QuantizedWeight((codes - offset).to(torch.int8), scale, zero, group, self.bits,
                               g_idx)


@dataclass(frozen=True)
class UnpackedInt8(LinearMethod):
    """int-quantized / naive-quantized: int8 weights as they are, a scale per tensor or channel,
    activations int8 per token (dynamic) or per tensor (static `input_scale`), or none."""

    symmetric: bool = True

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"weight", "weight_scale", "weight_zero_point", "input_scale",
                          "input_zero_point"})

    @property
    def required(self) -> frozenset[str]:
        need = {"weight", "weight_scale"} | (set() if self.symmetric else {"weight_zero_point"})
        static = self.activation is not None and self.activation.static
        return frozenset(need | ({"input_scale"} if static else set()))

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        weight = tensors["weight"]
        if weight.dtype != torch.int8:
            raise QuantizationError(f"checkpoint tensor {name}.weight is {weight.dtype}, the "
                                    "int-quantized format stores int8")
        out, cols = weight.shape
        scale, group = scale_per_row(f"{name}.weight_scale", tensors["weight_scale"], out, cols,
                                     None)
        zero = None
        if not self.symmetric:
            zp = tensors["weight_zero_point"]
            zero = zp.reshape(1, 1).expand(out, 1) if zp.numel() == 1 else zp.reshape(out, -1)
            zero = check_shape(f"{name}.weight_zero_point", zero, tuple(scale.shape)).to(torch.int8)
        act = self.activation
        return QuantizedWeight(weight, scale, zero, group, 8,
                               input_scale=_input_scale(tensors, act is not None and act.static))


@dataclass(frozen=True)
class Float8(LinearMethod):
    """float-quantized: float8_e4m3fn weights with a scale per tensor, channel or block."""

    block: tuple[int, int] | None = None

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"weight", "weight_scale", "input_scale"})

    @property
    def required(self) -> frozenset[str]:
        static = self.activation is not None and self.activation.static
        return frozenset({"weight", "weight_scale"} | ({"input_scale"} if static else set()))

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        weight = tensors["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise QuantizationError(f"checkpoint tensor {name}.weight is {weight.dtype}; FP8 "
                                    "checkpoints are served in float8_e4m3fn only")
        scale, group = fp8_scale(f"{name}.weight_scale", tensors["weight_scale"],
                                 tuple(weight.shape), self.block)
        act = self.activation
        return QuantizedWeight(weight, scale, None, group, 8,
                               input_scale=_input_scale(tensors, act is not None and act.static))


def fp8_scale(name: str, scale: Tensor, shape: tuple[int, int],
              block: tuple[int, int] | None) -> tuple[Tensor, int]:
    """An FP8 weight scale as float32 [out, groups]: per tensor / channel as is, a block scale
    [ceil(out/b0), ceil(in/b1)] repeated over the b0 rows of each block."""
    out, cols = shape
    if block is None:
        return scale_per_row(name, scale, out, cols, None)
    b0, b1 = block
    check_shape(name, scale, (-(-out // b0), -(-cols // b1)))
    return scale.float().repeat_interleave(b0, dim=0)[:out].contiguous(), b1


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    method: LinearMethod


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors target syntax: a class name ("Linear": every linear here), a module
    name, or "re:<regex>" matched against the module name."""
    for p in patterns:
        if p == "Linear" or p == name or name.endswith("." + p):
            return True
        if p.startswith("re:") and re.match(p[3:], name):
            return True
    return False


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, raw: dict[str, Any]) -> None:
        self.ignore = tuple(raw.get("ignore") or ())
        fmt = raw.get("format")
        self.groups = [_Group(tuple(g.get("targets") or ()), _method(g.get("format") or fmt, g,
                                                                      key))
                       for key, g in (raw.get("config_groups") or {}).items()]
        if not self.groups:
            raise QuantizationError("compressed-tensors quantization_config has no config_groups")

    def method_for(self, hf_name: str) -> LinearMethod | None:
        if _matches(hf_name, self.ignore):
            return None
        for group in self.groups:
            if _matches(hf_name, group.targets):
                return group.method
        return None


def _method(fmt: str | None, group: dict[str, Any], key: str) -> LinearMethod:
    w, a = group.get("weights") or {}, group.get("input_activations")
    bits, kind = int(w.get("num_bits", 8)), w.get("type", "int")
    strategy = w.get("strategy", "tensor")
    scheme = f"format {fmt!r}, {kind}{bits} weights per {strategy}" + \
        (f", {a.get('type', 'int')}{a.get('num_bits')} activations" if a else "")
    act = _activation(a, scheme)
    if w.get("dynamic"):
        raise _unsupported(scheme + " (dynamic weight scales)")
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8) and act is None \
            and strategy in ("group", "channel"):
        gs = int(w["group_size"]) if strategy == "group" else None
        return PackedInt(f"compressed-tensors W{bits}A16 ({strategy}"
                         f"{'' if gs is None else f' {gs}'})", None, bits, gs,
                         bool(w.get("symmetric", True)))
    if fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8 \
            and strategy in ("channel", "tensor") and (act is None or act.kind == "int8"):
        return UnpackedInt8(f"compressed-tensors W8A{'16' if act is None else '8'} int8", act,
                            bool(w.get("symmetric", True)))
    if fmt == "float-quantized" and kind == "float" and bits == 8 \
            and strategy in ("tensor", "channel", "block") and (act is None or act.kind == "fp8"):
        block = tuple(w["block_structure"]) if strategy == "block" else None
        return Float8(f"compressed-tensors FP8 ({strategy})", act, block)
    raise _unsupported(f"{scheme} (config group {key!r})")


def _activation(a: dict[str, Any] | None, scheme: str) -> ActivationScheme | None:
    if not a:
        return None
    kind = f"{a.get('type', 'int')}{a.get('num_bits')}"
    kind = {"int8": "int8", "float8": "fp8"}.get(kind)
    dynamic = a.get("dynamic", False)
    strategy = a.get("strategy", "tensor")
    ok = kind is not None and a.get("symmetric", True) and (
        (dynamic is True and strategy == "token") or (dynamic is False and strategy == "tensor"))
    if not ok:
        raise _unsupported(scheme + " (activations must be symmetric, dynamic per token or "
                           "static per tensor)")
    return ActivationScheme(kind, static=not dynamic)


def _unsupported(scheme: str) -> QuantizationError:
    return QuantizationError(f"compressed-tensors scheme not supported: {scheme}. Supported: "
                             f"{SUPPORTED}")

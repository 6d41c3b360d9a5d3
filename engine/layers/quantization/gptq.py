"""GPTQ checkpoints (`quant_method: gptq`, AutoGPTQ / GPTQModel layout): int4 or int8 codes
packed along the INPUT dim (`qweight` [in * bits / 32, out]), zero points packed along the output
dim (`qzeros`), fp16 `scales` [groups, out] and `g_idx` (act order, `desc_act`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig
from kvserve.engine.layers.quantization.qweight import QuantizedWeight, check_shape, unpack_int32


def trivial_g_idx(g_idx: Tensor, group_size: int) -> bool:
    """True when g_idx is just column // group_size (no act order)."""
    expected = torch.arange(g_idx.numel(), dtype=torch.int64) // group_size
    return torch.equal(g_idx.long().cpu(), expected)


@dataclass(frozen=True)
class GPTQMethod(LinearMethod):
    bits: int = 4
    group_size: int = 128  # -1: one group per output channel
    v1_zeros: bool = True  # checkpoint_format "gptq" (v1) stores zero - 1

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"qweight", "qzeros", "scales", "g_idx"})

    @property
    def required(self) -> frozenset[str]:
        return frozenset({"qweight", "qzeros", "scales"})

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        qweight, scales = tensors["qweight"], tensors["scales"]
        out = qweight.shape[1]
        cols = qweight.shape[0] * 32 // self.bits
        group = cols if self.group_size <= 0 else self.group_size
        groups = -(-cols // group)
        offset = 1 << (self.bits - 1)
        codes = unpack_int32(qweight, self.bits, cols, dim=0).t()  # [out, in]
        check_shape(f"{name}.scales", scales, (groups, out))
        zeros = unpack_int32(tensors["qzeros"], self.bits, out, dim=1)
        check_shape(f"{name}.qzeros", zeros, (groups, out))
        if self.v1_zeros:
            zeros = zeros + 1
        zero = (zeros.t() - offset).to(torch.int8).contiguous()
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            check_shape(f"{name}.g_idx", g_idx, (cols,))
            g_idx = None if trivial_g_idx(g_idx, group) else g_idx.to(torch.int32)
        return QuantizedWeight((codes - offset).to(torch.int8).contiguous(),
                               scales.float().t().contiguous(),
                               None if not zero.any() else zero, group, self.bits, g_idx)


class GPTQConfig(QuantConfig):
    """Every linear of the decoder layers (GPTQ leaves the lm_head dense unless `lm_head`)."""

    name = "gptq"

    def __init__(self, raw: dict[str, Any]) -> None:
        bits = int(raw.get("bits", 4))
        fmt = str(raw.get("checkpoint_format", "gptq"))
        if bits not in (4, 8):
            raise QuantizationError(f"GPTQ with {bits}-bit weights is not supported; supported: "
                                    "4 and 8 bits")
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"GPTQ checkpoint_format {fmt!r} is not supported; "
                                    "supported: gptq (v1), gptq_v2")
        if raw.get("lm_head") or raw.get("dynamic"):
            raise QuantizationError("GPTQ with a quantised lm_head or per-module `dynamic` "
                                    "overrides is not supported; supported: uniform bits and "
                                    "group size over the decoder layers")
        group = int(raw.get("group_size", 128))
        self.method = GPTQMethod(
            f"GPTQ {bits}-bit (group {group}{', act order' if raw.get('desc_act') else ''})",
            None, bits, group, fmt == "gptq")

    def method_for(self, hf_name: str) -> LinearMethod | None:
        return None if hf_name.rpartition(".")[2] == "lm_head" else self.method

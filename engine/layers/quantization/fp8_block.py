"""Native FP8 checkpoints (`quant_method: fp8`, as DeepSeek's and Qwen's official FP8 releases):
float8_e4m3fn weights with `weight_scale_inv` per 128x128 block (or a per-tensor
`weight_scale`). x86 has no FP8 GEMM: the weight is dequantised per call, the activations stay in
the model dtype (transformers' FP8 integration does the same on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig, names_module
from kvserve.engine.layers.quantization.compressed_tensors import fp8_scale
from kvserve.engine.layers.quantization.qweight import QuantizedWeight


@dataclass(frozen=True)
class Fp8BlockMethod(LinearMethod):
    block: tuple[int, int] | None = (128, 128)

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"weight", "weight_scale_inv", "weight_scale", "input_scale"})

    @property
    def required(self) -> frozenset[str]:
        return frozenset({"weight", "weight_scale_inv" if self.block else "weight_scale"})

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        weight = tensors["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise QuantizationError(f"checkpoint tensor {name}.weight is {weight.dtype}; FP8 "
                                    "checkpoints are served in float8_e4m3fn only")
        leaf = "weight_scale_inv" if self.block else "weight_scale"
        scale, group = fp8_scale(f"{name}.{leaf}", tensors[leaf], tuple(weight.shape), self.block)
        return QuantizedWeight(weight, scale, None, group, 8)


class Fp8Config(QuantConfig):
    name = "fp8"

    def __init__(self, raw: dict[str, Any]) -> None:
        fmt = str(raw.get("fmt", "e4m3"))
        if fmt != "e4m3":
            raise QuantizationError(f"FP8 format {fmt!r} is not supported; supported: e4m3")
        block = raw.get("weight_block_size")
        self.block = tuple(int(b) for b in block) if block else None
        self.skip = tuple(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ())
        self.method = Fp8BlockMethod(
            f"FP8 ({'block ' + 'x'.join(map(str, self.block)) if self.block else 'per tensor'})",
            None, self.block)

    def method_for(self, hf_name: str) -> LinearMethod | None:
        if hf_name.rpartition(".")[2] == "lm_head" or names_module(hf_name, self.skip):
            return None
        return self.method

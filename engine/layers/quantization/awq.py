"""AWQ checkpoints (`quant_method: awq`, version gemm): int4 codes packed eight to an int32 along
the OUTPUT dim in the nibble order 0, 2, 4, 6, 1, 3, 5, 7 (`qweight` [in, out / 8]), zero
points the same way (`qzeros` [groups, out / 8]), fp16 `scales` [groups, out]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig, names_module
from kvserve.engine.layers.quantization.qweight import QuantizedWeight, check_shape, unpack_int32

# nibble j of a word holds element AWQ_ORDER[j]; reading element e takes nibble REVERSE[e]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: Tensor) -> Tensor:
    """[rows, n / 8] int32 -> [rows, n] unsigned codes in element order."""
    nibbles = unpack_int32(packed, 4, packed.shape[1] * 8, dim=1)
    rows, n = nibbles.shape
    return nibbles.view(rows, n // 8, 8)[:, :, list(AWQ_REVERSE)].reshape(rows, n)


@dataclass(frozen=True)
class AWQMethod(LinearMethod):
    group_size: int = 128

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"qweight", "qzeros", "scales"})

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        codes = unpack_awq(tensors["qweight"]).t()  # [out, in]
        out, cols = codes.shape
        groups = -(-cols // self.group_size)
        scales = check_shape(f"{name}.scales", tensors["scales"], (groups, out))
        zeros = check_shape(f"{name}.qzeros", unpack_awq(tensors["qzeros"]), (groups, out))
        return QuantizedWeight((codes - 8).to(torch.int8).contiguous(),
                               scales.float().t().contiguous(),
                               (zeros.t() - 8).to(torch.int8).contiguous(), self.group_size, 4)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, raw: dict[str, Any]) -> None:
        bits, version = int(raw.get("bits", raw.get("w_bit", 4))), str(raw.get("version", "gemm"))
        if bits != 4 or version.lower() != "gemm" or not raw.get("zero_point", True):
            raise QuantizationError(
                f"AWQ {bits}-bit version {version!r} (zero_point={raw.get('zero_point', True)}) "
                "is not supported; supported: 4-bit, version gemm, with zero points")
        group = int(raw.get("group_size", raw.get("q_group_size", 128)))
        self.skip = tuple(raw.get("modules_to_not_convert") or ())
        self.method = AWQMethod(f"AWQ 4-bit (group {group})", None, group)

    def method_for(self, hf_name: str) -> LinearMethod | None:
        if hf_name.rpartition(".")[2] == "lm_head" or names_module(hf_name, self.skip):
            return None
        return self.method

"""GGUF (llama.cpp) quantised linears: Q8_0, Q4_0, Q4_1 and Q4_K blocks decoded once at load into
the format-neutral QuantizedWeight (int codes, one fp32 scale and zero point per 32 inputs), which
the W4A16 / W8 kernels serve. The repacking is lossless: every GGML block of these types is an
affine map of its codes per 32 columns, `w = (code - zero) * scale`, with ggml's fp16 factors
widened to fp32 (Q4_1's and Q4_K's offsets become fractional zero points)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.engine.errors import QuantizationError
from kvserve.engine.sizing.gguf_table import ggml_type_name
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig
from kvserve.engine.layers.quantization.qweight import QuantizedWeight

# ggml type id -> (name, elements per block, bytes per block); the ones served quantised
GGML_QUANT_TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                    12: ("Q4_K", 256, 144)}
GGML_DENSE_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
GROUP = 32  # every served type has one scale (and offset) per 32 inputs


def _f16(raw: Tensor) -> Tensor:
    """Little-endian fp16 from a [..., 2] uint8 tensor, as fp32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: Tensor) -> Tensor:
    """ggml's 4-bit order within 32 elements: the 16 bytes' low nibbles, then their high ones."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _q4_k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 six-bit (scale, min) pairs of each Q4_K super-block from its 12 packed bytes."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _affine(codes: Tensor, scale: Tensor, offset: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Unsigned 4-bit codes with w = code * scale + offset as (code - 8, scale, zero) of our
    layout: zero = -8 - offset / scale. A block whose scale is 0 holds `offset` everywhere:
    it becomes codes -8, scale 1, zero -8 - offset."""
    flat = scale == 0
    safe = torch.where(flat, torch.ones_like(scale), scale)
    zero = -8.0 - offset / safe
    codes = torch.where(flat.unsqueeze(-1), torch.zeros_like(codes), codes)
    return codes.to(torch.int8) - 8, safe, zero


def decode_blocks(raw: Tensor, type_id: int, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's bytes ([rows, cols / block * bytes] uint8, rows = output features) as a
    QuantizedWeight with group 32."""
    if type_id not in GGML_QUANT_TYPES:
        raise QuantizationError(
            f"GGUF tensors of type {ggml_type_name(type_id)} are not supported; supported: "
            f"{', '.join(n for n, _, _ in GGML_QUANT_TYPES.values())} (and F32 / F16 / BF16)")
    name, block, nbytes = GGML_QUANT_TYPES[type_id]
    if cols % block or raw.numel() != rows * cols // block * nbytes:
        raise QuantizationError(f"a {name} tensor of {raw.numel()} bytes cannot hold a "
                                f"[{rows}, {cols}] weight")
    b = raw.reshape(rows, cols // block, nbytes)
    if name == "Q8_0":
        values = b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return QuantizedWeight(values, _f16(b[..., 0:2]), None, GROUP, 8)
    if name == "Q4_0":
        codes = _nibbles(b[..., 2:]).to(torch.int8) - 8
        return QuantizedWeight(codes.reshape(rows, cols), _f16(b[..., 0:2]), None, GROUP, 4)
    if name == "Q4_1":
        codes, scale, zero = _affine(_nibbles(b[..., 4:]), _f16(b[..., 0:2]), _f16(b[..., 2:4]))
        return QuantizedWeight(codes.reshape(rows, cols), scale, zero, GROUP, 4)
    # Q4_K: 256 elements = 4 chunks of 64; chunk c's 32 bytes hold sub-block 2c in their low
    # nibbles and 2c + 1 in their high ones; w = d * sc * q - dmin * m per sub-block of 32.
    d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)
    sc, mn = _q4_k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, cols // block, 4, 1, 32)
    codes = torch.cat((qs & 0xF, qs >> 4), dim=3).reshape(rows, cols // block, 8, 32)
    codes, scale, zero = _affine(codes, d * sc, -dmin * mn)
    groups = cols // GROUP
    return QuantizedWeight(codes.reshape(rows, cols), scale.reshape(rows, groups),
                           zero.reshape(rows, groups), GROUP, 4)


def dequantize_gguf(raw: Tensor, type_id: int, shape: tuple[int, ...]) -> Tensor:
    """A GGUF tensor as fp32 of `shape` (dense types as stored; quantised ones decoded)."""
    if type_id in GGML_DENSE_TYPES:
        if raw.dtype == torch.uint8:  # BF16 comes as its bytes
            raw = raw.contiguous().view(torch.bfloat16)
        return raw.float().reshape(shape)
    cols, rows = shape[-1], math.prod(shape[:-1])
    return decode_blocks(raw, type_id, rows, cols).dequantize().reshape(shape)


@dataclass(frozen=True)
class GGUFLinearMethod(LinearMethod):
    """One linear whose GGUF tensor is quantised: the loader hands its raw block bytes as
    `qweight` and its ggml type id as `qweight_type` (vLLM's names)."""

    @property
    def leaves(self) -> frozenset[str]:
        return frozenset({"qweight", "qweight_type"})

    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        raw, type_id = tensors["qweight"], int(tensors["qweight_type"])
        block, nbytes = GGML_QUANT_TYPES.get(type_id, ("", 1, 1))[1:]
        rows = raw.shape[0]
        return decode_blocks(raw, type_id, rows, raw.shape[1] // nbytes * block)


class GGUFConfig(QuantConfig):
    """The linears a GGUF file stores quantised (by HF name): those get GGUFLinearMethod; dense
    ones (F32 / F16) and the lm_head stay dense."""

    name = "gguf"

    def __init__(self, quantized: dict[str, int]) -> None:
        self.quantized = quantized  # HF projection name -> ggml type id
        kinds = sorted({ggml_type_name(t) for t in quantized.values()})
        self.method = GGUFLinearMethod(description=f"GGUF {'/'.join(kinds)}")

    def method_for(self, hf_name: str) -> LinearMethod | None:
        if hf_name.endswith("lm_head") or hf_name not in self.quantized:
            return None
        return self.method

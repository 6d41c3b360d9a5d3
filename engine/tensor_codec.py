"""vLLM's tensor serialisation helpers (`vllm.utils.serial_utils`): a tensor as base64 of
`torch.save` (how clients send prompt embeddings), a NumPy array as base64 of `.npy`, and a
tensor as raw bytes of a named dtype and byte order (embeddings returned as bytes)."""

from __future__ import annotations

import base64
import io
import sys
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch


@dataclass(frozen=True)
class DTypeInfo:
    torch_dtype: torch.dtype
    torch_view_dtype: torch.dtype  # what NumPy can hold: bf16 travels as f16 bits, fp8 as u8
    numpy_view_dtype: type

    @property
    def nbytes(self) -> int:
        return self.torch_dtype.itemsize


EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
MmMetadataDType = Literal["int32", "int64", "uint8", "bool"]
Endianness = Literal["native", "big", "little"]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]

EMBED_DTYPES: dict[str, DTypeInfo] = {
    "float32": DTypeInfo(torch.float32, torch.float32, np.float32),
    "float16": DTypeInfo(torch.float16, torch.float16, np.float16),
    "bfloat16": DTypeInfo(torch.bfloat16, torch.float16, np.float16),
    "fp8_e4m3": DTypeInfo(torch.float8_e4m3fn, torch.uint8, np.uint8),
    "fp8_e5m2": DTypeInfo(torch.float8_e5m2, torch.uint8, np.uint8),
}
MM_METADATA_DTYPES: dict[str, DTypeInfo] = {
    "int32": DTypeInfo(torch.int32, torch.int32, np.int32),
    "int64": DTypeInfo(torch.int64, torch.int64, np.int64),
    "uint8": DTypeInfo(torch.uint8, torch.uint8, np.uint8),
    "bool": DTypeInfo(torch.bool, torch.uint8, np.uint8),
}
_ALL_DTYPES = {**EMBED_DTYPES, **MM_METADATA_DTYPES}
ENDIANNESS: tuple[str, ...] = get_args(Endianness)


def tensor2base64(x: torch.Tensor) -> str:
    """base64 of `torch.save(x)`: vLLM's encoding of `prompt_embeds` in a completions request."""
    with io.BytesIO() as buf:
        torch.save(x, buf)
        return base64.b64encode(buf.getvalue()).decode("utf-8")


def numpy2base64(array: np.ndarray) -> str:
    """base64 of the array's `.npy` file (no pickles)."""
    with io.BytesIO() as buf:
        np.save(buf, array, allow_pickle=False)
        return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor2binary(tensor: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    """The flattened tensor cast to `embed_dtype`, in the given byte order."""
    info = _dtype_info(embed_dtype, endianness)
    array = tensor.to(info.torch_dtype).flatten().contiguous().view(info.torch_view_dtype).numpy()
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return array.tobytes()


def binary2tensor(binary: bytes, shape: tuple[int, ...], embed_dtype: str,
                  endianness: str) -> torch.Tensor:
    """tensor2binary's inverse, for a known shape."""
    info = _dtype_info(embed_dtype, endianness)
    array = np.frombuffer(binary, dtype=info.numpy_view_dtype).reshape(shape)
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return torch.from_numpy(array.copy()).view(info.torch_dtype)


def _dtype_info(embed_dtype: str, endianness: str) -> DTypeInfo:
    if embed_dtype not in _ALL_DTYPES:
        raise ValueError(f"dtype {embed_dtype!r}: one of {sorted(_ALL_DTYPES)}")
    if endianness not in ENDIANNESS:
        raise ValueError(f"endianness {endianness!r}: one of {ENDIANNESS}")
    return _ALL_DTYPES[embed_dtype]

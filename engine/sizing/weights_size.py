"""A checkpoint's weight bytes and parameters read from its safetensors headers (never the tensors):
a local folder, the HF cache, or a hub repo through range requests. Shared by the engine's log and
metrics, `kvserve plan` and the operator's sizing.

Each tensor counts at its stored bytes (`data_offsets`), so quantised checkpoints (packed int32,
fp8, scales, zero points) are sized at what they really hold; a tied lm_head is counted once.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.engine.errors import ModelNotFoundError
from kvserve.engine.sizing.gguf_table import find_gguf, gguf_tensor_bytes

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# Floating dtypes the engine casts to its compute dtype when it loads them.
CAST_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # GGUF's dense types are named the same


class CheckpointReadError(ModelNotFoundError):
    """A model whose config.json or safetensors headers cannot be read. `reason` is a status
    condition's reason; `transient` says whether a retry later may succeed (network, 5xx)."""

    def __init__(self, message: str, reason: str = "ModelUnreadable",
                 transient: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.transient = transient


@dataclass(frozen=True)
class CheckpointWeights:
    """Parameters (tensor elements) and bytes of every tensor, per safetensors dtype."""

    params_by_dtype: dict[str, int]
    bytes_by_dtype: dict[str, int]
    num_tensors: int
    num_files: int
    source: str  # where the headers came from, for messages

    @property
    def parameters(self) -> int:
        return sum(self.params_by_dtype.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def resident_bytes(self, compute_dtype_bytes: int | None = None) -> int:
        """Bytes once loaded: floating tensors cast to the engine's dtype (when given); packed
        integers, fp8 and other quantised storage stay at their stored bytes."""
        if compute_dtype_bytes is None:
            return self.total_bytes
        cast = sum(p for d, p in self.params_by_dtype.items() if d in CAST_DTYPES)
        kept = sum(b for d, b in self.bytes_by_dtype.items() if d not in CAST_DTYPES)
        return cast * compute_dtype_bytes + kept

    def describe(self) -> str:
        parts = ", ".join(f"{d} {b / (1 << 30):.2f} GiB"
                          for d, b in sorted(self.bytes_by_dtype.items()))
        return (f"{self.parameters / 1e9:.3f}B parameters in {self.num_tensors} tensors / "
                f"{self.num_files} file(s) ({parts}) from {self.source}")


@dataclass(frozen=True)
class Checkpoint:
    """A model's config.json and the summary of its safetensors headers."""

    config: dict[str, Any]
    weights: CheckpointWeights
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(headers: Iterable[dict[str, Any]], source: str, num_files: int,
              tied_embeddings: bool = False) -> CheckpointWeights:
    """Sum the tensors of safetensors headers ({name: {dtype, shape, data_offsets}})."""
    tensors: dict[str, dict] = {}
    for header in headers:
        tensors.update((k, v) for k, v in header.items() if k != "__metadata__")
    if tied_embeddings and any(k.endswith("embed_tokens.weight") for k in tensors):
        tensors.pop("lm_head.weight", None)  # the engine holds one matrix for both
    params: dict[str, int] = {}
    size: dict[str, int] = {}
    for name, info in tensors.items():
        try:
            dtype, (start, end) = info["dtype"], info["data_offsets"]
            count = math.prod(info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointReadError(f"{source}: tensor {name!r} has a malformed safetensors "
                                      f"header entry {info!r}") from exc
        params[dtype] = params.get(dtype, 0) + count
        size[dtype] = size.get(dtype, 0) + (end - start)
    if not tensors:
        raise CheckpointReadError(f"{source}: the safetensors headers list no tensors")
    return CheckpointWeights(params, size, len(tensors), num_files, source)


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file: 8 bytes of length, then the JSON."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointReadError(f"{path}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):
                raise CheckpointReadError(f"{path}: header length {length} is not a "
                                          "safetensors file's (truncated or not safetensors)")
            return json.loads(f.read(length))
    except OSError as exc:
        raise CheckpointReadError(f"cannot read {path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointReadError(f"{path}: the safetensors header is not JSON ({exc})") from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointReadError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointReadError(f"{path} is not valid JSON: {exc}") from exc


def shard_names(files: Iterable[str], index: dict[str, Any] | None) -> list[str]:
    """The .safetensors files holding the weights: the index's shards, else the root files."""
    if index is not None:
        return sorted(set(index.get("weight_map", {}).values()))
    return sorted(f for f in files if f.endswith(".safetensors") and "/" not in f)


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json."""
    return _read_json(folder / "config.json")


def tied(config: dict[str, Any]) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def local_checkpoint(folder: Path | str) -> Checkpoint:
    """Read config.json and every shard's header from a model folder."""
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise CheckpointReadError(f"{folder} has no config.json: point at the folder holding "
                                  "config.json and the *.safetensors weights", "ModelNotFound")
    config = _read_json(folder / "config.json")
    index = _read_json(folder / INDEX_FILE) if (folder / INDEX_FILE).is_file() else None
    shards = shard_names((p.name for p in folder.iterdir()), index)
    if not shards and any(folder.glob("*.gguf")):
        return gguf_checkpoint(folder, config)
    if not shards:
        raise CheckpointReadError(f"{folder} holds no *.safetensors weights (.bin/.pt "
                                  "checkpoints cannot be sized from headers)")
    headers = [read_header(folder / name) for name in shards]
    return Checkpoint(config, summarize(headers, str(folder), len(shards), tied(config)))


def gguf_checkpoint(folder: Path, config: dict[str, Any] | None = None) -> Checkpoint:
    """A model folder's GGUF file sized from its tensor table: each tensor at its stored bytes
    (ggml blocks: codes with their fp16 scales), dtype named by its ggml type (Q4_1, F32...)."""
    path = find_gguf(folder)
    if path is None:
        raise CheckpointReadError(f"{folder} holds no .gguf file")
    config = config if config is not None else read_config(folder)
    try:
        by_type, count = gguf_tensor_bytes(path)
    except (ValueError, OSError) as exc:
        raise CheckpointReadError(f"{path}: not a readable GGUF file ({exc})") from exc
    params = {k: p for k, (p, _) in by_type.items()}
    size = {k: b for k, (_, b) in by_type.items()}
    return Checkpoint(config, CheckpointWeights(params, size, count, 1, str(path)))


def checkpoint_weight_bytes(path: Path | str) -> int:
    """Stored bytes of every tensor of a local checkpoint folder (quantised layouts included)."""
    return local_checkpoint(path).weights.total_bytes


def weights_log_line(resident_bytes: int, model_path: Path | str, compute_dtype_bytes: int,
                     quantization: str | None = None) -> str:
    """The engine's startup line: the weight bytes it holds, and the checkpoint headers' figure
    (what `kvserve plan` and the operator size with) when the folder is local and readable
    (its GGUF file's tensor table with quantization="gguf")."""
    line = f"model weights: {resident_bytes} bytes resident ({resident_bytes / (1 << 30):.3f} GiB)"
    if not Path(model_path).is_dir():
        return line
    try:
        read = gguf_checkpoint if quantization == "gguf" else local_checkpoint
        headers = read(Path(model_path)).weights.resident_bytes(compute_dtype_bytes)
    except CheckpointReadError as exc:
        return f"{line}; checkpoint headers unreadable: {exc}"
    return f"{line}; checkpoint headers say {headers} bytes"

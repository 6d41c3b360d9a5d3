"""The engine's side of checkpoint sizing: a GGUF file's tensor table (read with the loader's
torch-backed `GGUFFile`), the safetensors headers otherwise (engine/sizing/weights_size.py, which
stays torch-free for the operator), and the start-up line comparing them with what was loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.engine.sizing.weights_size import (GGUF_NOT_SIZED, Checkpoint, CheckpointReadError,
                                               CheckpointWeights, local_checkpoint, read_config)
from kvserve.engine.worker.gguf_loader import GGUFFile, find_gguf


def gguf_checkpoint(folder: Path, config: dict[str, Any] | None = None) -> Checkpoint:
    """A model folder's GGUF file sized from its tensor table: each tensor at its stored bytes
    (ggml blocks: codes with their fp16 scales), dtype named by its ggml type (Q4_1, F32...)."""
    path = find_gguf(folder)
    if path is None:
        raise CheckpointReadError(f"{folder} holds no .gguf file")
    config = config if config is not None else read_config(folder)
    try:
        file = GGUFFile(path)
    except (ValueError, OSError) as exc:
        raise CheckpointReadError(f"{path}: not a readable GGUF file ({exc})") from exc
    by_type = file.weight_bytes()
    params = {k: p for k, (p, _) in by_type.items()}
    size = {k: b for k, (_, b) in by_type.items()}
    return Checkpoint(config, CheckpointWeights(params, size, len(file.reader.tensors), 1,
                                                str(path)))


def engine_checkpoint(folder: Path | str) -> Checkpoint:
    """A local folder as the engine loads it: its safetensors headers, or its GGUF file's
    tensor table when it holds no safetensors."""
    try:
        return local_checkpoint(folder)
    except CheckpointReadError as exc:
        if exc.reason != GGUF_NOT_SIZED:
            raise
    return gguf_checkpoint(Path(folder).expanduser())


def weights_log_line(resident_bytes: int, model_path: Path | str, compute_dtype_bytes: int,
                     quantization: str | None = None) -> str:
    """The engine's startup line: the weight bytes it holds, and the checkpoint headers' figure
    (what `kvserve plan` and the operator size with) when the folder is local and readable
    (its GGUF file's tensor table with quantization="gguf")."""
    line = f"model weights: {resident_bytes} bytes resident ({resident_bytes / (1 << 30):.3f} GiB)"
    if not Path(model_path).is_dir():
        return line
    try:
        read = gguf_checkpoint if quantization == "gguf" else engine_checkpoint
        headers = read(Path(model_path)).weights.resident_bytes(compute_dtype_bytes)
    except CheckpointReadError as exc:
        return f"{line}; checkpoint headers unreadable: {exc}"
    return f"{line}; checkpoint headers say {headers} bytes"

"""A GGUF file's weight bytes from its tensor table (the `gguf` package's reader, numpy only, no
torch), so `kvserve plan` and the operator size a GGUF folder as the engine loads it."""

from __future__ import annotations

from pathlib import Path

from kvserve.engine.errors import ModelNotFoundError


def find_gguf(folder: Path) -> Path | None:
    """The one *.gguf file of a model folder (None when there is none)."""
    files = sorted(Path(folder).glob("*.gguf"))
    if len(files) > 1:
        raise ModelNotFoundError(f"{folder} holds {len(files)} GGUF files "
                                 f"({', '.join(f.name for f in files)}); keep one per folder")
    return files[0] if files else None


def ggml_type_name(type_id: int) -> str:
    """ggml's name of a tensor type (Q4_1, F32, ...), or `ggml type N` for one gguf lacks."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"ggml type {type_id}"


def gguf_tensor_bytes(path: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """ggml type name -> (parameters, stored bytes) over every tensor of a GGUF file, and the
    tensor count. Raises ValueError/OSError for a file that is not GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict[str, tuple[int, int]] = {}
    for t in reader.tensors:
        kind = ggml_type_name(int(t.tensor_type))
        params, size = out.get(kind, (0, 0))
        out[kind] = (params + int(t.n_elements), size + int(t.n_bytes))
    return out, len(reader.tensors)

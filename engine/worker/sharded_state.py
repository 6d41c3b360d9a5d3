"""vLLM's sharded-state checkpoints (`load_format="sharded_state"`): each tensor-parallel rank
writes its own shard of the built model (fused q/k/v, split heads: the tensors as they sit in the
model) to safetensors files, and reads them back with no resharding, so a rank never reads the
whole checkpoint. File names are vLLM's (`model-rank-{rank}-part-{part}.safetensors`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvserve.engine.errors import ConfigError


class ShardedStateLoader:
    """vLLM's loader of that name: `save_model` (one rank's shard, split into files of at most
    `max_size` bytes) and `load_model_shard` (a built, empty model of the same shape)."""

    TP_ONLY_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
    PP_AND_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    DEFAULT_MAX_FILE_SIZE = 5 * 1024**3

    @staticmethod
    def save_model(model: nn.Module, path: str | Path, pattern: str | None = None,
                   max_size: int | None = None, rank: int = 0) -> list[Path]:
        """Write this rank's tensors; each tensor shared by several names (tied embeddings) once."""
        from safetensors.torch import save_file

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        limit = max_size or ShardedStateLoader.DEFAULT_MAX_FILE_SIZE
        written = []
        for part, tensors in enumerate(_parts(shard_state(model), limit)):
            target = folder / _name(pattern, rank, part)
            save_file(tensors, str(target))
            written.append(target)
        return written

    @staticmethod
    def load_model_shard(model: nn.Module, path: str | Path, pattern: str | None = None,
                         rank: int = 0) -> None:
        """Fill every tensor of `model` from this rank's files; ConfigError when a file is
        missing, a tensor's shape differs (another tensor_parallel_size) or one is left out."""
        from safetensors import safe_open

        files = sorted(Path(path).glob(_name(pattern, rank, "*")))
        if not files:
            raise ConfigError(f"load_format='sharded_state': no {_name(pattern, rank, '*')} in "
                              f"{path}; write it with LLM.save_sharded_state at the same "
                              "tensor_parallel_size")
        state = model.state_dict()
        filled: set[tuple[int, int]] = set()
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    filled.add(_copy_into(state, key, f.get_tensor(key), file))
        missing = [k for k, t in state.items() if t.numel() and _ident(t) not in filled]
        if missing:
            raise ConfigError(f"load_format='sharded_state': {missing[:5]} missing from the "
                              f"shard files in {path}")


def shard_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The rank's tensors by name as the unpacked model holds them, each storage once (tied
    weights: the first name in order). A linear prepacked for oneDNN (CPU) keeps its weight only
    in the packed layout, outside the state dict: it is read back to the plain one, exactly."""
    from kvserve.engine.layers.packed_linear import PackedLinear

    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            state[f"{name}.weight"] = module.packed_weight.to_dense()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sorted(state.items()):
        if tensor.numel() and _ident(tensor) in seen:
            continue
        seen.add(_ident(tensor))
        out[key] = tensor
    return out


def _ident(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset()


def _parts(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > limit:
            parts.append({})
            size = 0
        parts[-1][key] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    return parts


def _name(pattern: str | None, rank: int, part: int | str) -> str:
    pattern = pattern or ShardedStateLoader.TP_ONLY_PATTERN
    return pattern.format(rank=rank, tp_rank=rank, pp_rank=0, part=part)


def _copy_into(state: dict[str, torch.Tensor], key: str, tensor: torch.Tensor,
               file: Path) -> tuple[int, int]:
    target = state.get(key)
    if target is None:
        raise ConfigError(f"load_format='sharded_state': {file.name} holds {key!r}, which this "
                          "model does not have (another model, or another tensor_parallel_size)")
    if target.shape != tensor.shape:
        raise ConfigError(f"load_format='sharded_state': {key} is {tuple(tensor.shape)} in "
                          f"{file.name}, {tuple(target.shape)} in this rank's model: the shards "
                          "were written at another tensor_parallel_size")
    with torch.no_grad():
        target.copy_(tensor)
    return _ident(target)

"""Loading HF-named checkpoint tensors into a decoder: q/k/v and gate/up fused into one linear
each (engine/layers/linear.py's PACKED_MODULES), quantised linears fed through their `take`, and
under tensor parallelism each rank reading only its slice."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from kvserve.engine.errors import ModelNotFoundError
from kvserve.engine.layers.linear import PACKED_MODULES, rank_slice, read_slice

# HF checkpoint projection -> (our fused linear, its shard index in it)
FUSED_TARGETS = {proj: (fused, i) for fused, projs in PACKED_MODULES.items()
                 for i, proj in enumerate(projs)}


class FusedWeightLoader:
    """load_weights for a decoder nn.Module that sets `dims` (DecoderDims), `shard` (TPShape)
    and `tp` (TPGroup | None); families with other checkpoint names rename them first."""

    packed_modules_mapping = PACKED_MODULES  # read by quantize_linears

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in (fusing q/k/v and gate/up); every parameter must be set."""
        params = dict(self.named_parameters())
        quantized = {n: m for n, m in self.named_modules() if hasattr(m, "take")}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name or (name == "lm_head.weight"
                                          and getattr(self, "tied_head",
                                                      self.dims.tie_embeddings)):
                continue
            target, shard = self._target(name)
            module, _, leaf = target.rpartition(".")
            if module in quantized and leaf != "bias":  # its method reads and repacks it
                quantized[module].take(leaf, shard, tensor, self._rank_slice(name))
                continue
            if target not in params:
                raise ModelNotFoundError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                    "is config.json's architecture right for these weights?")
            self._copy(params[target], shard, name, tensor)
            loaded.add(name)
        missing = sorted(self._expected_names() - loaded)
        if missing:
            raise ModelNotFoundError(
                f"the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}; the weight "
                "files are incomplete (re-download or re-fetch the model)")

    def _target(self, name: str) -> tuple[str, int | None]:
        prefix, _, leaf = name.rpartition(".")  # leaf: weight | bias
        module_prefix, _, proj = prefix.rpartition(".")
        if proj in FUSED_TARGETS:
            fused, shard = FUSED_TARGETS[proj]
            return f"{module_prefix}.{fused}.{leaf}", shard
        return name, None

    def _copy(self, param: nn.Parameter, shard: int | None, name: str, source) -> None:
        """`source`: the checkpoint tensor, or (tensor parallel) a lazy one this rank reads only
        its slice of."""
        dest = param.data
        if shard is not None:
            sizes = self._shard_sizes(name)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        tensor = source
        if self.tp is not None:
            prefix, _, leaf = name.rpartition(".")
            sl = rank_slice(prefix.rpartition(".")[2], leaf, self.shard, self.dims.head_dim)
            if sl is not None and sl.zero:
                dest.zero_()
                return
            tensor = read_slice(source, sl)
            if sl is not None and sl.dim == 0 and dest.shape[0] > sl.length:  # vocab padding
                dest = dest.narrow(0, 0, sl.length)
        if dest.shape != tensor.shape:
            raise ModelNotFoundError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(dest.shape)}: config.json does not match the weights")
        with torch.no_grad():
            dest.copy_(tensor)

    def _rank_slice(self, name: str):
        """This rank's rows or columns of the dense weight of projection `name` (None: all)."""
        if self.tp is None:
            return None
        proj = name.rpartition(".")[0].rpartition(".")[2]
        return rank_slice(proj, "weight", self.shard, self.dims.head_dim)

    def _shard_sizes(self, name: str) -> list[int]:
        d, s = self.dims, self.shard
        if ".self_attn." in name:
            return [s.num_heads * d.head_dim, s.num_kv_heads * d.head_dim,
                    s.num_kv_heads * d.head_dim]
        return [s.intermediate, s.intermediate]

    def _expected_names(self) -> set[str]:
        """The HF checkpoint names this model needs (fused params expanded back)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():  # tied lm_head.weight is not listed twice
            prefix, _, leaf = name.rpartition(".")
            module_prefix, _, proj = prefix.rpartition(".")
            head = f"{module_prefix}." if module_prefix else ""
            names.update(f"{head}{p}.{leaf}" for p in PACKED_MODULES.get(proj, (proj,)))
        return names

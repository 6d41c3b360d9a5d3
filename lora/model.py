"""LoRAModel: wraps a loaded model's adaptable linears in LoRALinear, checks an adapter
against the model's shapes, and copies an adapter into a slot (each tensor-parallel rank its
own share: B's rows of a column-parallel linear, A's columns of a row-parallel one, as the
base weights are split)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvserve.engine.errors import LoRAError
from kvserve.engine.layers.linear import PACKED_MODULES
from kvserve.lora.adapter import LoRAWeights
from kvserve.lora.layers import LoRABatch, LoRALinear

ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Target:
    """One LoRALinear as an adapter sees it: the HF names it answers to and the full
    (unsharded) shapes of its slices."""

    module: LoRALinear
    projs: tuple[str, ...]  # HF projection per slice
    in_full: int
    out_full: tuple[int, ...]
    row_parallel: bool


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class LoRAModel:
    """The adapter side of one rank's model: `max_loras` slots of rank <= `max_rank`."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.model, self.max_rank = model, max_rank
        self.batch = LoRABatch(max_loras)
        tp = getattr(model, "tp", None)
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.targets: dict[str, Target] = {}  # our module path -> target
        self._wrap(_pow2(max_rank))
        if not self.targets:
            raise LoRAError(f"{type(model).__name__} has no linear LoRA can adapt", "model")

    def _wrap(self, rank: int) -> None:
        p = next(self.model.parameters())
        dims = getattr(self.model, "dims", None)
        for parent_name, parent in list(self.model.named_modules()):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                base = getattr(parent, name, None)
                if base is None or isinstance(base, LoRALinear) or \
                        not hasattr(base, "out_features"):
                    continue
                widths, projs, out_full = self._slices(parent, name, base, dims)
                lora = LoRALinear(base, base.in_features, widths, self.batch, rank, p.dtype,
                                  p.device)
                setattr(parent, name, lora)
                row = name in ROW_PARALLEL
                in_full = base.in_features * (self.tp_size if row else 1)
                path = f"{parent_name}.{name}" if parent_name else name
                self.targets[path] = Target(lora, projs, in_full, out_full, row)

    def _slices(self, parent: nn.Module, name: str, base: nn.Module,
                dims) -> tuple[list[int], tuple[str, ...], tuple[int, ...]]:
        out, n = base.out_features, self.tp_size
        if name == "qkv_proj":
            q, kv = parent.q_size, parent.kv_size
            kv_full = dims.num_kv_heads * dims.head_dim if dims is not None else kv * n
            return [q, kv, kv], PACKED_MODULES[name], (q * n, kv_full, kv_full)
        if name == "gate_up_proj":
            return [out // 2] * 2, PACKED_MODULES[name], (out // 2 * n,) * 2
        return [out], (name,), (out,)

    # ---- adapters -----------------------------------------------------------------------------
    def resolve(self, weights: LoRAWeights) -> dict[str, list[tuple[int, Tensor, Tensor]]]:
        """Our module path -> [(slice, A, B)] (full shapes), or LoRAError naming what does not
        fit this model (a module it lacks, or shapes of another base model)."""
        plan: dict[str, list[tuple[int, Tensor, Tensor]]] = {}
        by_hf = self._hf_names()
        for hf, (a, b) in weights.modules.items():
            found = by_hf.get(hf)
            if found is None and _other_stage(self.model, hf):
                continue  # a layer another pipeline stage holds (and adapts)
            if found is None:
                raise LoRAError(f"adapter {weights.name!r} targets {hf!r}, which "
                                f"{type(self.model).__name__} does not have; was it trained for "
                                "another base model?")
            path, slices = found
            t = self.targets[path]
            outs = [t.out_full[i] for i in slices]
            if a.shape[1] != t.in_full or b.shape[0] != sum(outs):
                raise LoRAError(
                    f"adapter {weights.name!r} was trained for another base model: {hf!r} has "
                    f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, this model's "
                    f"projection takes {t.in_full} inputs to {sum(outs)} outputs")
            for i, part in zip(slices, b.split(outs, dim=0)):
                plan.setdefault(path, []).append((i, a, part))
        return plan

    def _hf_names(self) -> dict[str, tuple[str, list[int]]]:
        names: dict[str, tuple[str, list[int]]] = {}
        for path, t in self.targets.items():
            head = path.rpartition(".")[0]
            for i, proj in enumerate(t.projs):
                names[f"{head}.{proj}"] = (path, [i])
            names[path] = (path, list(range(len(t.projs))))  # a fused name: every slice
        return names

    @torch.no_grad()
    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Copy this rank's share of `weights` into `slot` (None: empty the slot)."""
        plan = self.resolve(weights) if weights is not None else {}
        for path, t in self.targets.items():
            given = {i: (a, b) for i, a, b in plan.get(path, [])}
            for i in range(len(t.projs)):
                a, b = given.get(i, (None, None))
                if a is not None and self.tp_size > 1:
                    a, b = self._shard(t, i, a, b)
                t.module.set_slot(slot, i, a, b)

    def _shard(self, t: Target, i: int, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        width = t.module.widths[i]
        if t.row_parallel:  # this rank's input columns of A; B whole (the output is reduced)
            k = t.module.in_features
            return a.narrow(1, self.tp_rank * k, k), b
        if t.projs[i] in ("k_proj", "v_proj"):
            shard = self.model.shard
            start = shard.kv_head_start * self.model.dims.head_dim
        else:
            start = self.tp_rank * width
        return a, b.narrow(0, start, width)

    def set_indices(self, indices: Tensor | None) -> None:
        """This step's slot per row of the flattened batch (-1: base model)."""
        self.batch.set(indices, next(self.model.parameters()).dtype)


def _other_stage(model: nn.Module, hf_name: str) -> bool:
    """Whether `hf_name` names a layer that another pipeline stage holds (a layer past the
    model's last is no stage's: the adapter was trained for another model)."""
    inner = getattr(model, "model", None)
    stage = getattr(inner, "pp", None)
    m = re.search(r"layers\.(\d+)\.", hf_name)
    if stage is None or m is None or stage.holds(int(m[1])):
        return False
    layers = getattr(inner, "layers", None)  # every layer's slot, another stage's a placeholder
    return layers is None or int(m[1]) < len(layers)


def attach_lora(model: nn.Module, config) -> LoRAModel:
    """Wrap `model`'s linears for `config` (a LoRAConfig); the handle is `model.lora_model`."""
    lora = LoRAModel(model, config.max_loras, config.max_lora_rank)
    model.lora_model = lora  # a plain attribute: not a submodule, not in state_dict
    return lora

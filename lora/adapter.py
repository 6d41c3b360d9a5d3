"""Reading a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) into
LoRAWeights: per HF module, A [r, in] and B [out, r] with the scaling (alpha / r, or
alpha / sqrt(r) for rsLoRA) folded into B. Checks that need no model are here; the model's
shapes are checked where the weights meet it (lora/model.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvserve.engine.errors import LoRAError

# The HF projection names an adapter may target (Phi-3's fused ones too).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAWeights:
    """One adapter in host memory: HF module path -> (A [r, in], B [out, r] * scaling)."""

    name: str
    rank: int
    modules: dict[str, tuple[Tensor, Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter_config(path: str | Path) -> dict:
    folder = Path(path)
    cfg_file = folder / "adapter_config.json"
    if not folder.is_dir() or not cfg_file.is_file():
        raise LoRAError(f"{str(path)!r} is not a LoRA adapter: expected a folder holding "
                        "adapter_config.json and adapter_model.safetensors (PEFT's "
                        "save_pretrained)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_file} must hold a JSON object")
    return cfg


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoRAWeights:
    """The adapter's scaled weights; LoRAError naming the reason when it cannot be served."""
    cfg = read_adapter_config(path)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"adapter {name!r} is a {peft_type} adapter; only LoRA is supported")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}; "
                        "start the engine with a larger --max-lora-rank")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise LoRAError(f"adapter {name!r} sets {key}={bad}, which is not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"adapter {name!r} saves whole modules {cfg['modules_to_save']} "
                        "(modules_to_save); only LoRA matrices are supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r} trains biases (bias={cfg['bias']!r}); only "
                        "bias='none' is supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoRAError(f"adapter {name!r} uses rank_pattern/alpha_pattern; one rank and alpha "
                        "for every module is supported")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _read_tensors(Path(path), name)
    return LoRAWeights(name, rank, _pair(tensors, name, rank, scaling))


def _read_tensors(folder: Path, name: str) -> dict[str, Tensor]:
    st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(st))
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
            raise LoRAError(f"adapter {name!r}: {st} cannot be read: {exc}") from None
    if binary.is_file():
        return torch.load(str(binary), map_location="cpu", weights_only=True)
    raise LoRAError(f"adapter {name!r}: {folder} has adapter_config.json but no "
                    "adapter_model.safetensors (or adapter_model.bin)")


def _pair(tensors: dict[str, Tensor], name: str, rank: int,
          scaling: float) -> dict[str, tuple[Tensor, Tensor]]:
    parts: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA matrix of a "
                            f"target module this engine can adapt; supported target modules: "
                            f"{', '.join(TARGETS)}")
        module = m.group("module")
        proj = module.rpartition(".")[2]
        if proj not in TARGETS:
            raise LoRAError(f"adapter {name!r} targets module {module!r}, which this engine "
                            f"cannot adapt; supported target modules: {', '.join(TARGETS)}")
        parts.setdefault(module, {})[m.group("ab")] = t
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: module {module!r} lacks lora_"
                            f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} "
                            f"and lora_B {tuple(b.shape)}, not of rank r={rank}")
        out[module] = (a.contiguous(), (b * scaling).contiguous())
    if not out:
        raise LoRAError(f"adapter {name!r} holds no LoRA matrices")
    return out

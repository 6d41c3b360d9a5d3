"""Builders for the LoRA tests: random PEFT adapters (A and B both random, so the output
changes) saved beside a base checkpoint, and the HF + peft merged model as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, out: Path, seed: int, r: int = 8, alpha: float = 16,
                  targets: list[str] | None = None, rslora: bool = False,
                  scale: float = 0.1) -> Path:
    """A random LoRA for the checkpoint at `base` (peft save_pretrained into `out`)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                     init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # peft's random init is small; make the adapter matter
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    peft_model.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path | None):
    """HF fp32 eager model with `adapter` merged in (None: the base model)."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager").eval()
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory) -> Path:
    """A tiny Llama (2 layers, GQA 4:2) for the LoRA tests."""
    from conftest import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("lora") / "base")


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory) -> list[Path]:
    """Four adapters: all seven projections (one rsLoRA, one of rank 4), and one on q and v
    only."""
    root = tmp_path_factory.mktemp("adapters")
    return [build_adapter(lora_base, root / "a0", seed=10),
            build_adapter(lora_base, root / "a1", seed=11, rslora=True),
            build_adapter(lora_base, root / "a2", seed=12, r=4, alpha=4),
            build_adapter(lora_base, root / "a3", seed=13, targets=["q_proj", "v_proj"],
                          scale=0.3)]

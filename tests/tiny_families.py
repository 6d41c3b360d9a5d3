"""Tiny random checkpoints of several families, built with transformers' own config and model
classes + save_pretrained (never downloaded): what sizing tests read headers and configs from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASE: dict[str, Any] = dict(vocab_size=256, hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=4,
                            max_position_embeddings=512)
# family -> (config class, model class, overrides): MoE with every expert, windows, head_dim.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, head_dim=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(intermediate_size=96, head_dim=16, sliding_window=32, num_hidden_layers=6)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(intermediate_size=96, head_dim=16, sliding_window=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=48, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, head_dim=16, decoder_sparse_step=2,
                       mlp_only_layers=[0])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, shared_expert_intermediate_size=48)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(intermediate_size=96, tie_word_embeddings=True)),
}


def build_family(name: str, path: Path, **save: Any) -> tuple[Path, Any]:
    """Save a random tiny `name` model to `path`; returns (path, the HF model)."""
    import torch
    import transformers

    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(path, **save)
    return path, model


def tensor_bytes(folder: Path) -> int:
    """The real bytes of every tensor in a folder's .safetensors files (read in full)."""
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    return total

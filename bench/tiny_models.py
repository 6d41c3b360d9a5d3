"""Tiny random checkpoints of other families for the engine benchmarks: transformers' own config
class and model class, random weights, the default model's tokenizer (so the chat workload is
tokenised as for the default model), saved as an HF folder."""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes small enough for a 2-core CPU run, with the structure that matters: routing over many
# experts, a few per token (Qwen3-30B-A3B routes 8 of 128; Mixtral 2 of 8; gpt-oss 4 of 32).
TINY_CONFIGS: dict[str, dict] = {
    "Qwen3MoeForCausalLM": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=4, head_dim=32, num_experts=16,
                                num_experts_per_tok=4, moe_intermediate_size=128,
                                intermediate_size=512, norm_topk_prob=True),
    "MixtralForCausalLM": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                               intermediate_size=256),
    "GptOssForCausalLM": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=32, num_local_experts=16,
                              num_experts_per_tok=4, intermediate_size=128, sliding_window=128),
}


def build_tiny(arch: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Save a random `arch` model of TINY_CONFIGS[arch]'s shape with the tokenizer of
    `tokenizer_dir` into `folder` (once: an existing folder is reused)."""
    import transformers

    if (folder / "config.json").is_file():
        return folder
    if arch not in TINY_CONFIGS:
        raise SystemExit(f"--tiny {arch}: known tiny configs are {sorted(TINY_CONFIGS)}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = dict(TINY_CONFIGS[arch], vocab_size=len(tokenizer), max_position_embeddings=2048,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

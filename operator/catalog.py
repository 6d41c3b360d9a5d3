"""Built-in catalogs: model architectures (for the memory budget) and GPU types (memory each).

The model catalog is the offline fallback: a model outside it, or one the operator can read,
is sized from its own config.json and safetensors headers (`arch_from_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.engine.sizing.memory import LayerGroup
from kvserve.engine.sizing.model_shape import (
    active_parameter_count, head_dim, kv_heads, layer_groups, moe_shape, parameter_count, text_config,
)
from kvserve.engine.sizing.weights_size import Checkpoint, CheckpointWeights

MiB = 1 << 20


@dataclass(frozen=True)
class ModelArch:
    """What sizing needs to know of a model; `source` is what the engine is told to load."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    parameters: int
    dtype: str  # the checkpoint's own dtype, used when spec.engine.dtype is "auto"
    max_model_len: int
    source: str = ""
    layer_groups: tuple[LayerGroup, ...] = ()  # empty: every layer full attention
    weights: CheckpointWeights | None = None  # from the safetensors headers, when read
    origin: str = "catalog"  # where the figures come from, for status and `kvserve plan`
    active_parameters: int = 0  # an MoE's parameters per token (top-k experts); 0: all
    tied_embeddings: bool = False  # lm_head shares the embedding (each end stage holds a copy)

    def active_share(self) -> float:
        """The share of the weights one decoded token reads (1.0 for a dense model)."""
        return self.active_parameters / self.parameters if self.active_parameters else 1.0

    def weight_bytes(self, compute_dtype_bytes: int) -> int:
        """Resident weight bytes: the headers' (quantised tensors at their stored bytes), or
        parameters x the engine dtype when only a parameter count is known."""
        if self.weights is not None:
            return self.weights.resident_bytes(compute_dtype_bytes)
        return self.parameters * compute_dtype_bytes


def arch_from_config(config: dict[str, Any], source: str, parameters: int | None = None,
                     weights: CheckpointWeights | None = None,
                     origin: str = "catalog") -> ModelArch:
    """A ModelArch from a config.json (any family). An MoE layer's activations are its top-k
    experts', so `intermediate` is experts_per_token x the expert width there."""
    c = text_config(config)
    moe = moe_shape(c)
    inter = moe.experts_per_token * moe.expert_intermediate if moe else c["intermediate_size"]
    count = weights.parameters if weights is not None else parameter_count(config)
    dtype = str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype") or
                "bfloat16")
    return ModelArch(
        layers=c["num_hidden_layers"], heads=c["num_attention_heads"], kv_heads=kv_heads(c),
        head_dim=head_dim(c), hidden=c["hidden_size"], intermediate=inter,
        vocab=c["vocab_size"], parameters=parameters or count,
        dtype=dtype if dtype in ("float32", "float16", "bfloat16") else "bfloat16",
        max_model_len=int(c.get("max_position_embeddings") or 4096), source=source,
        layer_groups=layer_groups(config), weights=weights, origin=origin,
        active_parameters=active_parameter_count(config) if moe else 0,
        tied_embeddings=bool(c.get("tie_word_embeddings", False)))


def arch_from_checkpoint(checkpoint: Checkpoint, source: str) -> ModelArch:
    """Sized from the model's own files: config.json shapes, weight bytes from the headers."""
    return arch_from_config(checkpoint.config, source, weights=checkpoint.weights,
                            origin=f"files: {checkpoint.weights.describe()}")


# Figures from each model's config.json on the Hugging Face hub; `parameters` from its weights.
MODELS: dict[str, ModelArch] = {
    "llama-2-7b": ModelArch(32, 32, 32, 128, 4096, 11008, 32000, 6_738_415_616, "float16", 4096,
                            "meta-llama/Llama-2-7b-hf"),
    "llama-2-13b": ModelArch(40, 40, 40, 128, 5120, 13824, 32000, 13_015_864_320, "float16", 4096,
                             "meta-llama/Llama-2-13b-hf"),
    "llama-2-70b": ModelArch(80, 64, 8, 128, 8192, 28672, 32000, 68_976_648_192, "float16", 4096,
                             "meta-llama/Llama-2-70b-hf"),
    "llama-3-8b": ModelArch(32, 32, 8, 128, 4096, 14336, 128256, 8_030_261_248, "bfloat16", 8192,
                            "meta-llama/Meta-Llama-3-8B"),
    "llama-3-70b": ModelArch(80, 64, 8, 128, 8192, 28672, 128256, 70_553_706_496, "bfloat16",
                             8192, "meta-llama/Meta-Llama-3-70B"),
    "mistral-7b": ModelArch(32, 32, 8, 128, 4096, 14336, 32000, 7_241_732_096, "bfloat16", 32768,
                            "mistralai/Mistral-7B-v0.1"),
    "qwen2.5-7b": ModelArch(28, 28, 4, 128, 3584, 18944, 152064, 7_615_616_512, "bfloat16", 32768,
                            "Qwen/Qwen2.5-7B"),
    "smollm2-135m": ModelArch(30, 9, 3, 64, 576, 1536, 49152, 134_515_008, "bfloat16", 8192,
                              "smollm2-135m-instruct"),
}

# config.json fields of newer families, as published on the hub (only the fields sizing reads).
# Parameters are counted from these shapes (engine/sizing/model_shape.py: every expert, lm_head once
# when tied). Where each came from (copies of the official config.json seen on huggingface.co):
#   llama-3.1-8b / 70b: meta-llama/Llama-3.1-{8B,70B}-Instruct config.json (llama3 rope, 131072)
#   qwen3-8b: "Copy config.json from Qwen/Qwen3-8B"; qwen3-32b: a verbatim copy of Qwen3-32B's
#   qwen3-30b-a3b: Qwen3-30B-A3B's shape (48 layers, 128 experts x 768, top 8, 4 KV heads) as in
#     the Qwen3-Coder-30B-A3B config.json and MindSpeed-RL's qwen3_30b_a3b.yaml
#   gemma-3-27b: google/gemma-3-27b's text_config (62 layers, 16 KV heads x 128, window 1024,
#     every 6th layer global, vocab 262208) as cached in a public HF-config table
#   gpt-oss-20b / 120b: openai/gpt-oss-*'s config.json (24/36 layers, 32/128 experts, window 128
#     on alternating layers, vocab 201088). The hub checkpoints hold MXFP4 experts: read from the
#     hub they are sized at those bytes; this entry sizes the bf16 layout the engine loads.
#   mixtral-8x7b: mistralai/Mixtral-8x7B-Instruct-v0.1's config.json (sliding_window null)
#   phi-4: microsoft/phi-4's config.json (Phi3ForCausalLM, 40 KV-grouped heads, 16384 context)
#   llama-3.1-405b: meta-llama/Llama-3.1-405B-Instruct's config.json (126 layers, 128 heads, 8 KV
#     heads, hidden 16384, MLP 53248); the models that need more than one 8-GPU node at 16 bits
#   qwen3-235b-a22b: Qwen/Qwen3-235B-A22B's config.json (94 layers, 64 heads, 4 KV heads x 128,
#     128 experts x 1536, top 8)
# DeepSeek-V3/R1 is not here: its attention (MLA) caches one 576-wide latent per token and layer,
# which the per-head KV formula of engine/sizing/memory.py would overstate 70-fold.
_LLAMA31 = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
            "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
            "attention_bias": True, "sliding_window": 128, "vocab_size": 201088,
            "num_experts_per_tok": 4, "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16"}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", _LLAMA31),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B-Instruct", {
        **_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64}),
    "qwen3-8b": ("Qwen/Qwen3-8B", {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}),
    "qwen3-32b": ("Qwen/Qwen3-32B", {
        "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "head_dim": 128,
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960, "use_sliding_window": False,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "head_dim": 128, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}),
    "gemma-3-27b": ("google/gemma-3-27b-it", {
        "model_type": "gemma3", "text_config": {
            "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
            "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 128, "sliding_window": 1024, "sliding_window_pattern": 6,
            "vocab_size": 262208, "max_position_embeddings": 131072,
            "tie_word_embeddings": True}, "torch_dtype": "bfloat16"}),
    "gpt-oss-20b": ("openai/gpt-oss-20b", {
        **_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 12}),
    "gpt-oss-120b": ("openai/gpt-oss-120b", {
        **_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18}),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-Instruct-v0.1", {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
        "vocab_size": 32000, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B-Instruct", {
        **_LLAMA31, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
        "num_attention_heads": 128}),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
        "head_dim": 128, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}),
    "phi-4": ("microsoft/phi-4", {
        "model_type": "phi3", "hidden_size": 5120, "intermediate_size": 17920,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
        "vocab_size": 100352, "max_position_embeddings": 16384, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}),
}
MODELS.update({key: arch_from_config(config, source) for key, (source, config) in
               CONFIGS.items()})

# Other spellings users type for the same entries (lower-cased on lookup).
ALIASES: dict[str, str] = {
    "smollm2-135m-instruct": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/llama-2-13b-hf": "llama-2-13b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.2": "mistral-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    **{source.lower(): key for key, (source, _) in CONFIGS.items()},
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-405b": "llama-3.1-405b",
    "google/gemma-3-27b-pt": "gemma-3-27b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
}


@dataclass(frozen=True)
class GPUType:
    memory_bytes: int  # total device memory as the driver reports it (nvidia-smi)
    product: str  # the `nvidia.com/gpu.product` label GPU feature discovery sets
    memory_bandwidth: float = 0.0  # bytes/s of device memory (the datasheet's figure)
    per_node: int = 8  # GPUs in the usual node of this type (8-GPU HGX boards, g5/g6.48xlarge)


TB = 1e12
GPUS: dict[str, GPUType] = {
    "L4": GPUType(23034 * MiB, "NVIDIA-L4", 0.3 * TB),
    "A10G": GPUType(23028 * MiB, "NVIDIA-A10G", 0.6 * TB),
    "L40S": GPUType(46068 * MiB, "NVIDIA-L40S", 0.864 * TB),
    "A100-40GB": GPUType(40960 * MiB, "NVIDIA-A100-SXM4-40GB", 1.555 * TB),
    "A100-80GB": GPUType(81920 * MiB, "NVIDIA-A100-SXM4-80GB", 2.039 * TB),
    "H100-80GB": GPUType(81559 * MiB, "NVIDIA-H100-80GB-HBM3", 3.35 * TB),
    "H200-141GB": GPUType(143771 * MiB, "NVIDIA-H200", 4.8 * TB),
}


def lookup_model(name: str) -> tuple[str, ModelArch] | None:
    """The catalog key and entry for a model name or alias (case-insensitive), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    arch = MODELS.get(key)
    return (key, arch) if arch is not None else None

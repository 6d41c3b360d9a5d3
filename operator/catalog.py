"""Built-in catalogs: model architectures (for the memory budget) and GPU types (memory each)."""

from __future__ import annotations

from dataclasses import dataclass

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
}


@dataclass(frozen=True)
class GPUType:
    memory_bytes: int  # total device memory as the driver reports it (nvidia-smi)
    product: str  # the `nvidia.com/gpu.product` label GPU feature discovery sets


GPUS: dict[str, GPUType] = {
    "L4": GPUType(23034 * MiB, "NVIDIA-L4"),
    "A10G": GPUType(23028 * MiB, "NVIDIA-A10G"),
    "L40S": GPUType(46068 * MiB, "NVIDIA-L40S"),
    "A100-40GB": GPUType(40960 * MiB, "NVIDIA-A100-SXM4-40GB"),
    "A100-80GB": GPUType(81920 * MiB, "NVIDIA-A100-SXM4-80GB"),
    "H100-80GB": GPUType(81559 * MiB, "NVIDIA-H100-80GB-HBM3"),
    "H200-141GB": GPUType(143771 * MiB, "NVIDIA-H200"),
}


def lookup_model(name: str) -> tuple[str, ModelArch] | None:
    """The catalog key and entry for a model name or alias (case-insensitive), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    arch = MODELS.get(key)
    return (key, arch) if arch is not None else None

"""Our model implementations, looked up by the HF architecture name in config.json."""

from __future__ import annotations

from torch import nn

from kvserve.engine.errors import ConfigError
from kvserve.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """Our class for an HF architecture name, or a ConfigError listing what is supported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"model architecture {architecture!r} is not supported by kvserve; supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))}. Pick a model of one of these families.") from None


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class"]

"""Our model implementations, looked up by the HF architecture name in config.json."""

from __future__ import annotations

from torch import nn

from kvserve.engine.errors import ConfigError
from kvserve.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvserve.engine.models.gpt_oss import GptOssForCausalLM
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.models.mistral import MistralForCausalLM
from kvserve.engine.models.mixtral import MixtralForCausalLM
from kvserve.engine.models.phi3 import Phi3ForCausalLM
from kvserve.engine.models.qwen2 import Qwen2ForCausalLM
from kvserve.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from kvserve.engine.models.qwen3 import Qwen3ForCausalLM
from kvserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """Our class for an HF architecture name, or a ConfigError listing what is supported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"model architecture {architecture!r} is not supported by kvserve; supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))}. Pick a model of one of these families.") from None


# config.model_type -> architecture, for configs saved without `architectures`.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}


def model_class_for(config) -> type[nn.Module]:
    """Our class for an HF config: its first `architectures` entry, else its model_type."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return get_model_class(archs[0])
    model_type = getattr(config, "model_type", None)
    return get_model_class(_BY_MODEL_TYPE.get(model_type, f"<model_type {model_type!r}>"))


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class", "model_class_for"]

"""Quantisation methods of linears, chosen from a checkpoint's `quantization_config` (or the
`quantization` engine argument): each format's reader and each device's kernels live here."""

from __future__ import annotations

from typing import Any

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization.base import LinearMethod, QuantConfig
from kvserve.engine.layers.quantization.quant_linear import QuantLinear, finish_quantized, \
    quantize_linears

# quant_method -> reader of its quantization_config
_CHECKPOINT_FORMATS = ("compressed-tensors", "gptq", "awq", "fp8")
QUANTIZATION_CHOICES = ("int8", "fp8", "compressed-tensors", "gptq", "awq", "gguf")  # = EngineConfig's


def quant_config_for(hf_config: Any, quantization: str | None = None) -> QuantConfig | None:
    """The checkpoint's quantisation, or the online one `quantization` asks for; None = dense.

    `quantization` on a quantised checkpoint must name its own method (as vLLM's flag)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"quantization {quantization!r} is not supported; choose one of "
                                f"{QUANTIZATION_CHOICES}")
    if not raw:
        if quantization in (None, *_CHECKPOINT_FORMATS[:3]):
            if quantization is not None:
                raise QuantizationError(f"quantization={quantization!r} reads a checkpoint "
                                        "quantised in that format, but config.json has no "
                                        "quantization_config; use int8 or fp8 to quantise at load")
            return None
        from kvserve.engine.layers.quantization.online import OnlineConfig

        return OnlineConfig(quantization)
    method = str(raw.get("quant_method", "")).lower()
    if quantization is not None and quantization != method:
        raise QuantizationError(
            f"the checkpoint is already quantised ({method}); quantization={quantization!r} "
            f"cannot re-quantise it. Drop the flag or pass quantization={method!r}")
    return _checkpoint_config(method, raw)


def _checkpoint_config(method: str, raw: dict[str, Any]) -> QuantConfig:
    if method == "compressed-tensors":
        from kvserve.engine.layers.quantization.compressed_tensors import CompressedTensorsConfig

        return CompressedTensorsConfig(raw)
    if method == "gptq":
        from kvserve.engine.layers.quantization.gptq import GPTQConfig

        return GPTQConfig(raw)
    if method == "awq":
        from kvserve.engine.layers.quantization.awq import AWQConfig

        return AWQConfig(raw)
    if method == "fp8":
        from kvserve.engine.layers.quantization.fp8_block import Fp8Config

        return Fp8Config(raw)
    raise QuantizationError(
        f"quantization_config quant_method {method!r} is not supported; supported: "
        f"{', '.join(_CHECKPOINT_FORMATS)} (and GGUF files), or an unquantised checkpoint with "
        "quantization='int8' or 'fp8'")


__all__ = ["QUANTIZATION_CHOICES", "LinearMethod", "QuantConfig", "QuantLinear",
           "finish_quantized", "quant_config_for", "quantize_linears"]

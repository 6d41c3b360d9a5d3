"""The two interfaces of quantisation: a QuantConfig (read from a checkpoint's
`quantization_config`, or from --quantization) says which method each linear uses, and a
LinearMethod owns that linear's checkpoint tensors, their repacking at load and the matmul."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvserve.engine.layers.quantization.activation import ActivationScheme
from kvserve.engine.layers.quantization.dequant import DequantLinear
from kvserve.engine.layers.quantization.int8_w8a8 import Int8W8A8Linear
from kvserve.engine.layers.quantization.qweight import QuantizedWeight
from kvserve.engine.layers.quantization.weight_only import Int4WeightLinear, Int8WeightLinear, \
    int4_supported, int8_supported


@dataclass(frozen=True)
class LinearMethod(ABC):
    """One quantisation scheme of one linear. `read` turns the checkpoint tensors of one
    (unfused) projection into a QuantizedWeight; `kernel` repacks the fused weight once and
    returns the module whose forward is the matmul (without bias)."""

    description: str  # for logs and errors, e.g. "compressed-tensors W4A16 (group 32)"
    activation: ActivationScheme | None = None

    @property
    @abstractmethod
    def leaves(self) -> frozenset[str]:
        """The checkpoint tensor names (`<proj>.<leaf>`) this method takes, bias excepted."""

    @property
    def required(self) -> frozenset[str]:
        """The leaves every projection must have (a missing one is named at load)."""
        return self.leaves

    @abstractmethod
    def read(self, tensors: dict[str, Tensor], name: str) -> QuantizedWeight:
        """`tensors`: leaf -> tensor of the projection `name` (its HF name, for errors)."""

    def kernel(self, w: QuantizedWeight, dtype: torch.dtype) -> nn.Module:
        """The fastest matmul this device has for `w` and this method's activations."""
        act = self.activation
        if w.values.is_cuda:
            gpu = _gpu_kernel(w, dtype, act)
            if gpu is not None:
                return gpu
        if act is not None and act.kind == "int8" and w.zero is None and w.scale.shape[1] == 1 \
                and w.g_idx is None and not w.is_float:
            return Int8W8A8Linear(w, w.input_scale if act.static else None)
        if act is None and int4_supported(w):
            return Int4WeightLinear(w, dtype)
        if act is None and int8_supported(w):
            return Int8WeightLinear(w, dtype)
        return DequantLinear(w, dtype, act, w.input_scale if act and act.static else None)


def _gpu_kernel(w: QuantizedWeight, dtype: torch.dtype,
                act: ActivationScheme | None) -> nn.Module | None:
    from kvserve.engine.layers.quantization.gpu_linear import ScaledMMFp8Linear, \
        TritonW4A16Linear, gpu_kernel_choice

    choice = gpu_kernel_choice(w, act, torch.cuda.get_device_capability(w.values.device))
    if choice == "scaled_mm_fp8":
        return ScaledMMFp8Linear(w, dtype, w.input_scale if act and act.static else None)
    if choice == "triton_w4a16":
        return TritonW4A16Linear(w, dtype)
    return None


def names_module(hf_name: str, modules: tuple[str, ...]) -> bool:
    """Whether a `modules_to_not_convert` / `ignored_layers` entry names `hf_name` or a module
    holding it, by whole dotted parts: "gate" (an MoE router) or "mlp.gate" leaves
    experts.0.gate_proj quantised, where a substring test would not."""
    padded = f".{hf_name}."
    return any(f".{m.strip('.')}." in padded for m in modules if m.strip("."))


class QuantConfig(ABC):
    """A checkpoint's (or the flag's) quantisation: which LinearMethod each linear gets."""

    name: str

    @abstractmethod
    def method_for(self, hf_name: str) -> LinearMethod | None:
        """The method of the projection `hf_name` (e.g. model.layers.0.self_attn.q_proj); None
        = the linear stays dense (ignored modules, lm_head)."""

"""What the mixture-of-experts families share on top of the dense decoder: which layers are
sparse (decoder_sparse_step, mlp_only_layers), and loading the expert tensors, in either HF
layout (one 2-D tensor per expert and projection, or gpt-oss's stacked ones), into FusedMoE."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import Tensor

from kvserve.engine.errors import ConfigError, ModelNotFoundError, QuantizationError
from kvserve.engine.layers.moe import FusedMoE
from kvserve.engine.models.config_keys import check_config_keys, require_value
from kvserve.engine.models.decoder import DecoderForCausalLM

# Checkpoint names are first brought to ours: Mixtral's block_sparse_moe and gpt-oss's router.
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".mlp.router.", ".mlp.gate."))
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(\w+)")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\."
                      r"(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)"
                     r"\.(\w+)")
_ROUTER = re.compile(r"model\.layers\.\d+\.mlp\.(gate|shared_expert_gate)\.(\w+)")
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks")
_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
         "down_proj": "down"}
# Our parameters that the dense loader must not expect: FusedMoE and sinks load here.
_OURS = re.compile(r"\.mlp\.(w13|w2|b13|b2)$|\.mlp\.shared_expert\.|\.sinks$")
STACKED_LEAVES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def sparse_layers(config, num_experts: int) -> tuple[bool, ...]:
    """Per layer, whether it is an MoE layer: HF's rule for Qwen2/3-MoE (every
    decoder_sparse_step-th layer, except mlp_only_layers); every layer for the others."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                 for i in range(config.num_hidden_layers))


# quant_method of the quantised MoE checkpoints served (their experts kept quantised)
MOE_QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")


def refuse_quantized(config, family: str, supported: tuple[str, ...] = ()) -> None:
    """A quantization_config whose quant_method is not in `supported` is refused (gpt-oss's
    MXFP4 or any quantised gpt-oss checkpoint; formats kvserve reads for no model)."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", quant)
        if method in supported:
            return
        served = (f"supported: {', '.join(supported)} checkpoints, --quantization int8|fp8 on "
                  "the dense checkpoint, or " if supported else "use ")
        raise ConfigError(
            f"{family}: quantization_config (quant_method {method!r}) is not supported for "
            f"this mixture-of-experts model; {served}the bf16 (or fp16/fp32) checkpoint")


def check_swiglu_moe_config(config, family: str, understood: frozenset[str]) -> None:
    """The checks the SwiGLU MoE families (Mixtral, Qwen2/3-MoE) make first: every config key
    understood, quantised experts only in a format served, silu experts."""
    check_config_keys(config, family, understood)
    refuse_quantized(config, family, MOE_QUANT_METHODS)
    require_value(config, "hidden_act", ("silu",), family)


class MoEDecoderForCausalLM(DecoderForCausalLM):
    """A DecoderForCausalLM whose spec makes some layers FusedMoE; the dense loader reads every
    other tensor (attention, norms, router, dense MLPs, embeddings)."""

    stacked_experts = False  # the checkpoint holds [E, ...] tensors (gpt-oss), not one per expert

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        loaded: set[str] = set()
        super().load_weights(self._dense_only(weights, loaded))
        missing = sorted(self._moe_expected() - loaded)
        if missing:
            raise ModelNotFoundError(
                f"the checkpoint lacks {len(missing)} expert tensor(s), e.g. {missing[:3]}; the "
                "weight files are incomplete (re-download or re-fetch the model)")

    def _dense_only(self, weights: Iterable[tuple[str, Tensor]],
                    loaded: set[str]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            key = self._load_moe(name, tensor)
            if key is None:
                yield name, tensor
            else:
                loaded.add(key)

    def _moe(self, layer: str, name: str) -> FusedMoE:
        i = int(layer)
        if i >= len(self.model.layers) or not isinstance(self.model.layers[i].mlp, FusedMoE):
            raise ModelNotFoundError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__}: layer {i} is not an MoE layer")
        return self.model.layers[i].mlp

    def _load_moe(self, name: str, tensor) -> str | None:
        """Load `name` if it is ours; the canonical key it filled, or None (not ours)."""
        if m := _EXPERT.fullmatch(name):
            proj = _PROJ[m[3]]
            self._moe(m[1], name).load_expert(int(m[2]), proj, tensor, name, m[4])
            return f"model.layers.{m[1]}.mlp.experts.{m[2]}.{proj}"
        if m := _STACKED.fullmatch(name):
            self._moe(m[1], name).load_stacked(m[2], tensor, name)
            return name
        if m := _SHARED.fullmatch(name):
            proj = _PROJ[m[2]]
            self._moe(m[1], name).load_shared(proj, tensor, name, m[3])
            return f"model.layers.{m[1]}.mlp.shared_expert.{proj}"
        if (m := _ROUTER.fullmatch(name)) and m[2] not in ("weight", "bias"):
            raise QuantizationError(
                f"checkpoint tensor {name!r}: this checkpoint quantises the MoE router, which "
                "kvserve keeps dense (as vLLM does); quantise it with the router ignored "
                "(llm-compressor: ignore=['lm_head', 're:.*mlp.gate$'])")
        if m := _SINKS.fullmatch(name):
            self._load_sinks(int(m[1]), tensor, name)
            return name
        return None

    def _load_sinks(self, i: int, source, name: str) -> None:
        attn = self.model.layers[i].self_attn.attn
        if tuple(source.shape) != (self.dims.num_heads,):
            raise ModelNotFoundError(f"checkpoint tensor {name!r} has shape "
                                     f"{tuple(source.shape)}, the model expects "
                                     f"({self.dims.num_heads},)")
        attn.load_sinks(source.narrow(0, self.shard.q_head_start, self.shard.num_heads))

    def _moe_expected(self) -> set[str]:
        names: set[str] = set()
        for i, layer in enumerate(self.model.layers):
            if not self.model.pp.holds(i):  # another pipeline stage's
                continue
            head = f"model.layers.{i}."
            if getattr(layer.self_attn.attn, "sinks", None) is not None:
                names.add(head + "self_attn.sinks")
            if not isinstance(layer.mlp, FusedMoE):
                continue
            spec = layer.mlp.spec
            if self.stacked_experts:
                names.update(f"{head}mlp.experts.{leaf}" for leaf in STACKED_LEAVES)
            else:
                names.update(f"{head}mlp.experts.{e}.{p}" for e in range(spec.num_experts)
                             for p in ("gate", "up", "down"))
            if spec.shared_intermediate:
                names.update(f"{head}mlp.shared_expert.{p}" for p in ("gate", "up", "down"))
        return names

    def _expected_names(self) -> set[str]:
        return {n for n in super()._expected_names() if not _OURS.search(n)}

"""Phi-3 / Phi-4: the Llama stack with q/k/v and gate/up already fused in the checkpoint
(qkv_proj, gate_up_proj), optional partial rotary and LongRoPE, and a sliding window on every
layer when config.sliding_window is set."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

from kvserve.engine.models.config_keys import check_config_keys, require_value
from kvserve.engine.models.decoder import DecoderForCausalLM, DecoderSpec, decoder_dims
from kvserve.engine.layers.linear import read_slice
from kvserve.engine.models.windows import layer_windows

# resid_pdrop / embd_pdrop: dropout, off at inference; partial_rotary_factor and
# original_max_position_embeddings are read through rope_parameters. Phi-4-mini's config also
# carries the fields of NEUTRAL, which HF's Phi3 ignores: accepted at those values only.
PHI3_KEYS = frozenset({"hidden_act", "sliding_window", "resid_pdrop", "embd_pdrop",
                       "original_max_position_embeddings", "partial_rotary_factor",
                       "attention_bias", "mlp_bias", "lm_head_bias", "full_attn_mod",
                       "interpolate_factor"})
NEUTRAL = {"attention_bias": (None, False), "mlp_bias": (None, False),
           "lm_head_bias": (None, False), "full_attn_mod": (None, 1),
           "interpolate_factor": (None, 1)}


class Phi3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        check_config_keys(config, "Phi3ForCausalLM", PHI3_KEYS)
        require_value(config, "hidden_act", ("silu",), "Phi3ForCausalLM")
        for key, allowed in NEUTRAL.items():
            require_value(config, key, allowed, "Phi3ForCausalLM")
        return DecoderSpec(decoder_dims(config),
                           windows=layer_windows(config, all_layers_slide=True),
                           max_model_len=max_model_len)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """The fused checkpoint tensors are split back into HF's q/k/v and gate/up names, so
        the decoder's loader fuses (and, under tensor parallelism, slices) them as usual."""
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        d = self.dims
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        parts = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 "gate_up_proj": (("gate_proj", d.intermediate), ("up_proj", d.intermediate))}
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            module, _, proj = prefix.rpartition(".")
            if proj not in parts:
                yield name, tensor
                continue
            whole = read_slice(tensor, None)  # a lazy (tensor-parallel) tensor is read here
            start = 0
            for part, size in parts[proj]:
                yield f"{module}.{part}.{leaf}", whole.narrow(0, start, size)
                start += size

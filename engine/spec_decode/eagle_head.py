"""EAGLE and EAGLE-3 draft heads in the checkpoint layouts published for Llama 3.x / Qwen3, run
over a paged KV cache with the engine's own layers (attention, norms, gated MLP, rotary).

EAGLE-1 (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` [hidden, 2*hidden] (bias optional) fuses
the token's embedding with the target's last hidden state (after its final norm); one Llama layer
(`layers.0.*`, no input norm) follows; its output goes to the target's lm_head as is.

EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, Tengyunw/qwen3_8b_eagle3): `fc` [hidden,
3*target_hidden] fuses three of the target's intermediate hidden states (the residual stream
entering layers `eagle_aux_hidden_state_layer_ids`, default (2, L/2, L-3)); one layer
(`midlayer.*`) whose attention reads [input_layernorm(embedding), hidden_norm(state)] (2*hidden
wide); a final `norm`; its own `lm_head` over a reduced vocabulary of `draft_vocab_size` ids
mapped to the target's by `d2t` (target id = draft id + d2t[draft id]; `t2d` is not needed).
`embed_tokens` is the target's unless the checkpoint has its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kvserve.engine.distributed import TPShape
from kvserve.engine.errors import ConfigError, ModelNotFoundError
from kvserve.engine.layers.attention import AttentionOps
from kvserve.engine.layers.linear import empty_embedding, skip_init_linear
from kvserve.engine.layers.mlp import GatedMLP
from kvserve.engine.layers.rotary import RotaryEmbedding
from kvserve.engine.models.decoder import DecoderAttention, DecoderSpec, decoder_dims
from kvserve.engine.models.weight_loader import FusedWeightLoader
from kvserve.kernels.metadata import AttentionMetadata

SKIPPED = ("t2d", "rotary_emb.")  # checkpoint tensors a head does not need


class _HeadLayer(nn.Module):
    """The head's one decoder layer (names as the checkpoint's, after `midlayer.` -> `layer.`)."""

    def __init__(self, spec: DecoderSpec, shape: TPShape, eagle3: bool, dtype, device) -> None:
        super().__init__()
        d = spec.dims
        self.self_attn = DecoderAttention(spec, 0, shape, None, dtype, device)
        if eagle3:  # its attention reads [embedding, state]: twice the width
            attn = self.self_attn
            attn.qkv_proj = skip_init_linear(2 * d.hidden, attn.q_size + 2 * attn.kv_size,
                                             d.qkv_bias, dtype, device)
            self.input_layernorm = spec.norm(d.hidden, dtype, device)
            self.hidden_norm = spec.norm(d.hidden, dtype, device)
        self.post_attention_layernorm = spec.norm(d.hidden, dtype, device)
        self.mlp = GatedMLP(d.hidden, d.intermediate, d.mlp_bias, None, dtype, device)


class EagleHead(FusedWeightLoader, nn.Module):
    """One EAGLE / EAGLE-3 head: `forward` maps (token ids, states) to (states for the logits,
    states to feed back for the next draft)."""

    def __init__(self, config: Any, eagle3: bool, dtype: torch.dtype, device: torch.device,
                 target_hidden: int, max_model_len: int | None, fc_bias: bool = False,
                 own_embedding: bool = False) -> None:
        super().__init__()
        if getattr(config, "num_hidden_layers", 1) != 1:
            raise ConfigError(f"EAGLE heads with {config.num_hidden_layers} layers are not "
                              "supported; the published heads have one")
        self.eagle3, self.tp, self.dtype = eagle3, None, dtype
        self.config = config
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.spec = spec = DecoderSpec(decoder_dims(config), max_model_len=max_model_len)
        self.dims = d = spec.dims
        self.shard = shape = TPShape.of(0, 1, d.num_heads, d.num_kv_heads, d.intermediate,
                                        d.vocab)
        self.layer = _HeadLayer(spec, shape, eagle3, dtype, device)
        self.rotary = RotaryEmbedding(config, d.head_dim, dtype, device,
                                      max_model_len=max_model_len)
        width = 3 * target_hidden if eagle3 else 2 * d.hidden
        self.fc = skip_init_linear(width, d.hidden, fc_bias, dtype, device)
        if own_embedding:
            self.embed_tokens = empty_embedding(d.vocab, d.hidden, dtype, device)
        if eagle3:
            self.draft_vocab = int(getattr(config, "draft_vocab_size", None) or d.vocab)
            self.norm = spec.norm(d.hidden, dtype, device)
            self.lm_head = skip_init_linear(d.hidden, self.draft_vocab, False, dtype, device)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64,
                                                    device=device))
        self._shared: dict[str, nn.Module] = {}  # the target's modules (not this head's params)
        self._ops: AttentionOps | None = None

    def share(self, embed_tokens: nn.Module | None, lm_head: Any | None) -> None:
        """Use the target's embedding (unless the head has one) and, EAGLE-1, its lm_head."""
        if embed_tokens is not None:
            self._shared["embed"] = embed_tokens
        if lm_head is not None:
            self._shared["lm_head"] = lm_head

    def embed(self, ids: Tensor) -> Tensor:
        table = getattr(self, "embed_tokens", None) or self._shared.get("embed")
        if table is None:
            raise ConfigError("this EAGLE head has no embed_tokens and no target embedding "
                              "was shared with it")
        return table(ids)

    def combine(self, target_states: Tensor) -> Tensor:
        """EAGLE-3: the target's three intermediate states [T, 3*H_t] -> [T, hidden] (the fc);
        EAGLE-1: the target's last states as they are."""
        return self.fc(target_states) if self.eagle3 else target_states

    def forward(self, ids: Tensor, positions: Tensor, states: Tensor,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        if self._ops is None:
            self._ops = AttentionOps.resolve()
        meta = self._ops.prepare(meta, kv_cache[0].shape[1])
        layer = self.layer
        emb = self.embed(ids).to(self.dtype)
        if self.eagle3:
            if self.norm_before_residual:
                x = layer.hidden_norm(states)
                residual = x.clone()
            else:
                residual, x = states.clone(), layer.hidden_norm(states)
            x = torch.cat([layer.input_layernorm(emb), x], dim=-1)
        else:  # EAGLE-1: fc over [embedding, state], no input norm
            x = self.fc(torch.cat([emb, states.to(self.dtype)], dim=-1))
            residual = x.clone()
        rope = self.rotary(positions)
        x = layer.self_attn(x, self.rotary, rope, kv_cache, meta, self._ops)
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
        if self.eagle3:
            return self.norm(x, residual)
        out = x + residual
        return out, out

    def draft_ids(self, states: Tensor) -> Tensor:
        """Greedy target token ids from the head's output states."""
        if not self.eagle3:
            return self._shared["lm_head"](states).argmax(dim=-1)
        ids = self.lm_head(states).argmax(dim=-1)
        return ids + self.d2t[ids]

    def load_checkpoint(self, tensors: dict[str, Tensor]) -> None:
        """The head's tensors by their published names (midlayer. or layers.0.)."""
        renamed = {}
        for name, t in tensors.items():
            if name.startswith(SKIPPED):
                continue
            name = name.removeprefix("model.")
            for old in ("midlayer.", "layers.0."):
                if name.startswith(old):
                    name = "layer." + name[len(old):]
            renamed[name] = t
        d2t = renamed.pop("d2t", None)
        if self.eagle3:
            if d2t is None and self.draft_vocab != self.dims.vocab:
                raise ModelNotFoundError("an EAGLE-3 head with a reduced vocabulary needs d2t")
            if d2t is not None:
                self.d2t.copy_(d2t.to(torch.int64))
        if not self.eagle3:
            renamed.pop("lm_head.weight", None)  # EAGLE-1 scores with the target's head
        if not hasattr(self, "embed_tokens"):
            renamed.pop("embed_tokens.weight", None)
        self.load_weights(renamed.items())


def read_head(path: str | Path) -> tuple[Any, dict[str, Tensor]]:
    """The head's config and tensors from a folder (config.json + *.safetensors or *.bin)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"EAGLE head {str(path)!r}: no config.json there (a local "
                                 "folder with the head's config.json and weights)")
    raw = json.loads((folder / "config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    tensors: dict[str, Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        for f in sorted(folder.glob("*.bin")):
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    if not tensors:
        raise ModelNotFoundError(f"EAGLE head {str(path)!r} holds no *.safetensors or *.bin")
    return config, tensors


def write_random_head(path: str | Path, target_config: Any, *, eagle3: bool = True,
                      draft_vocab_size: int | None = None, seed: int = 0,
                      std: float = 0.05) -> Path:
    """A random head in the published layout for `target_config` (tests, the GPU bench):
    acceptance of such a head means nothing, only its shapes and speed do."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h = target_config.hidden_size
    heads = target_config.num_attention_heads
    kv = getattr(target_config, "num_key_value_heads", None) or heads
    hd = getattr(target_config, "head_dim", None) or h // heads
    inter = target_config.intermediate_size
    vocab = target_config.vocab_size
    dv = draft_vocab_size or vocab

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g) * std

    pre = "midlayer." if eagle3 else "layers.0."
    t = {f"{pre}self_attn.q_proj.weight": rnd(heads * hd, 2 * h if eagle3 else h),
         f"{pre}self_attn.k_proj.weight": rnd(kv * hd, 2 * h if eagle3 else h),
         f"{pre}self_attn.v_proj.weight": rnd(kv * hd, 2 * h if eagle3 else h),
         f"{pre}self_attn.o_proj.weight": rnd(h, heads * hd),
         f"{pre}mlp.gate_proj.weight": rnd(inter, h), f"{pre}mlp.up_proj.weight": rnd(inter, h),
         f"{pre}mlp.down_proj.weight": rnd(h, inter),
         f"{pre}post_attention_layernorm.weight": 1 + rnd(h)}
    if eagle3:
        keep = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
        t |= {"fc.weight": rnd(h, 3 * h), "midlayer.input_layernorm.weight": 1 + rnd(h),
              "midlayer.hidden_norm.weight": 1 + rnd(h), "norm.weight": 1 + rnd(h),
              "lm_head.weight": rnd(dv, h) * 20, "d2t": keep - torch.arange(dv),
              "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, keep, True)}
    else:
        t["fc.weight"] = rnd(h, 2 * h)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "vocab_size", "hidden_act", "bos_token_id",
            "eos_token_id")
    config = {k: getattr(target_config, k) for k in keys
              if getattr(target_config, k, None) is not None}
    config |= {"num_hidden_layers": 1, "model_type": "llama", "tie_word_embeddings": False,
               "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "EagleLlamaForCausalLM"]}
    if eagle3:
        config |= {"draft_vocab_size": dv, "target_hidden_size": h}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder

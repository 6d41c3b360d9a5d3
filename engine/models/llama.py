"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache: which layers (engine/layers/)
in which order, and the HF weight names.

One forward takes a flattened batch of prefill and decode tokens ([T] ids and positions, no
padding); each layer writes its new K/V through the slot mapping and attends through the block
tables with `kvserve.kernels`. q/k/v and gate/up are fused into one matmul each at load time.
With a TPGroup (tensor parallelism) each rank holds its heads, its slice of the MLP and of the
vocabulary (engine/distributed.py), and all-reduces after o_proj, down_proj and the embedding;
without one the model is the plain unsharded one, with no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvserve.engine.distributed import TPGroup, TPShape
from kvserve.engine.errors import ConfigError, ModelNotFoundError
from kvserve.engine.layers.attention import Attention, AttentionOps
from kvserve.engine.layers.layernorm import RMSNorm
from kvserve.engine.layers.linear import rank_slice, read_slice, skip_init_linear
from kvserve.engine.layers.mlp import GatedMLP
from kvserve.engine.layers.rotary import RotaryEmbedding
from kvserve.engine.layers.vocab_embedding import VocabParallelEmbedding
from kvserve.engine.models.windows import layer_windows
from kvserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaDims:
    """The shapes a layer needs, read once from the HF config."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_embeddings: bool

    @classmethod
    def from_config(cls, config) -> "LlamaDims":
        heads = config.num_attention_heads
        is_qwen2 = getattr(config, "model_type", "") == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (Llama-family uses 'silu')")
        return cls(
            hidden=config.hidden_size, intermediate=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size, eps=config.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


class LlamaAttention(nn.Module):
    def __init__(self, d: LlamaDims, s: TPShape, tp: TPGroup | None, dtype, device=None,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, d.head_dim
        self.q_size, self.kv_size = s.num_heads * d.head_dim, s.num_kv_heads * d.head_dim
        self.tp = tp
        self.qkv_proj = skip_init_linear(d.hidden, self.q_size + 2 * self.kv_size, d.qkv_bias,
                                         dtype, device)
        self.o_proj = skip_init_linear(self.q_size, d.hidden, d.o_bias, dtype, device)
        self.attn = Attention(s.num_heads, s.num_kv_heads, d.head_dim, d.head_dim ** -0.5,
                              sliding_window=window)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], kv_cache: tuple[Tensor, Tensor],
                attn: AttentionMetadata, attn_ops: AttentionOps) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = self.o_proj(self.attn(q, k, v, kv_cache, attn, attn_ops, rope))
        return out if self.tp is None else self.tp.all_reduce(out)  # row parallel


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: LlamaDims, s: TPShape, tp: TPGroup | None, dtype, device=None,
                 window: int | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(d, s, tp, dtype, device, window)
        self.mlp = GatedMLP(d.hidden, s.intermediate, d.mlp_bias, tp, dtype, device)
        self.input_layernorm = RMSNorm(d.hidden, d.eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.eps, dtype, device)

    def forward(self, x: Tensor, residual: Tensor | None, rope: tuple[Tensor, Tensor],
                kv_cache: tuple[Tensor, Tensor], attn: AttentionMetadata,
                attn_ops: AttentionOps) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer, or the
        final norm, adds the two in its fused add + RMSNorm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, attn, attn_ops)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, d: LlamaDims, s: TPShape, tp: TPGroup | None, dtype,
                 device=None, max_model_len: int | None = None) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = torch.nn.utils.skip_init(
                nn.Embedding, d.vocab, d.hidden, dtype=dtype, device=device)
        else:
            self.embed_tokens = VocabParallelEmbedding(s, d.hidden, tp, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, d.head_dim, dtype, device,
                                          max_model_len=max_model_len)
        # Mistral slides on every layer; Qwen2 on those layer_types names (use_sliding_window).
        windows = layer_windows(config, all_layers_slide=config.model_type == "mistral")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(d, s, tp, dtype, device, windows[i] if windows else None)
            for i in range(d.num_layers))
        self.norm = RMSNorm(d.hidden, d.eps, dtype, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn: AttentionMetadata, attn_ops: AttentionOps) -> Tensor:
        if kv_caches:
            attn = attn_ops.prepare(attn, kv_caches[0][0].shape[1])
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rope, kv_cache, attn.for_layer(i), attn_ops)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


# HF checkpoint name -> (our fused parameter, shard index) for the fused projections.
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM over a paged KV cache (interface used by ModelRunner)."""

    # our fused linear -> the checkpoint projections in it (quantised linears load per shard)
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                              "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config, dtype: torch.dtype, device: torch.device | None = None,
                 tp: TPGroup | None = None, max_model_len: int | None = None) -> None:
        super().__init__()
        self.config, self.dtype, self.tp = config, dtype, tp
        self.dims = d = LlamaDims.from_config(config)
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.shard = s = TPShape.of(rank, size, d.num_heads, d.num_kv_heads, d.intermediate,
                                    d.vocab)
        self.model = LlamaModel(config, d, s, tp, dtype, device, max_model_len)
        self.lm_head = skip_init_linear(d.hidden, s.vocab_per_rank, False, dtype, device)
        if d.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._ops: AttentionOps | None = None

    @property
    def max_position(self) -> int:
        """Longest position the rope table covers (an upper bound for max_model_len)."""
        return self.model.rotary_emb.max_len

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn: AttentionMetadata) -> Tensor:
        """[T] token ids and positions -> hidden states [T, hidden] after the final norm."""
        if self._ops is None:
            self._ops = AttentionOps.resolve()
        return self.model(input_ids, positions, kv_caches, attn, self._ops)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[S, hidden] -> logits [S, vocab] in the model's dtype; the sampler widens them to
        float32 for every stage but a plain greedy argmax, which needs no copy. Tensor parallel:
        each rank's vocabulary slice is gathered to rank 0; the other ranks get None."""
        logits = self.lm_head(hidden)
        return logits if self.tp is None else self.tp.gather_logits(logits, self.dims.vocab)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors in (fusing q/k/v and gate/up); every parameter must be set."""
        params = dict(self.named_parameters())
        quantized = {n: m for n, m in self.named_modules() if hasattr(m, "take")}
        expected = self._expected_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name or (name == "lm_head.weight" and self.dims.tie_embeddings):
                continue
            target, shard = self._target(name)
            module, _, leaf = target.rpartition(".")
            if module in quantized and leaf != "bias":  # its method reads and repacks it
                quantized[module].take(leaf, shard, tensor, self._rank_slice(name))
                continue
            if target not in params:
                raise ModelNotFoundError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                    "is config.json's architecture right for these weights?")
            self._copy(params[target], shard, name, tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelNotFoundError(
                f"the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}; the weight "
                "files are incomplete (re-download or re-fetch the model)")

    def _target(self, name: str) -> tuple[str, int | None]:
        prefix, _, leaf = name.rpartition(".")  # leaf: weight | bias
        module_prefix, _, proj = prefix.rpartition(".")
        if proj in _FUSED:
            fused, shard = _FUSED[proj]
            return f"{module_prefix}.{fused}.{leaf}", shard
        return name, None

    def _copy(self, param: nn.Parameter, shard: int | None, name: str, source) -> None:
        """`source`: the checkpoint tensor, or (tensor parallel) a lazy one this rank reads only
        its slice of."""
        dest = param.data
        if shard is not None:
            sizes = self._shard_sizes(name)
            offset = sum(sizes[:shard])
            dest = dest.narrow(0, offset, sizes[shard])
        tensor = source
        if self.tp is not None:
            prefix, _, leaf = name.rpartition(".")
            sl = rank_slice(prefix.rpartition(".")[2], leaf, self.shard, self.dims.head_dim)
            if sl is not None and sl.zero:
                dest.zero_()
                return
            tensor = read_slice(source, sl)
            if sl is not None and sl.dim == 0 and dest.shape[0] > sl.length:  # vocab padding
                dest = dest.narrow(0, 0, sl.length)
        if dest.shape != tensor.shape:
            raise ModelNotFoundError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(dest.shape)}: config.json does not match the weights")
        with torch.no_grad():
            dest.copy_(tensor)

    def _rank_slice(self, name: str):
        """This rank's rows or columns of the dense weight of projection `name` (None: all)."""
        if self.tp is None:
            return None
        proj = name.rpartition(".")[0].rpartition(".")[2]
        return rank_slice(proj, "weight", self.shard, self.dims.head_dim)

    def _shard_sizes(self, name: str) -> list[int]:
        d, s = self.dims, self.shard
        if ".self_attn." in name:
            return [s.num_heads * d.head_dim, s.num_kv_heads * d.head_dim,
                    s.num_kv_heads * d.head_dim]
        return [s.intermediate, s.intermediate]

    def _expected_names(self) -> set[str]:
        """The HF checkpoint names this model needs (fused params expanded back)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():  # tied lm_head.weight is not listed twice
            prefix, _, leaf = name.rpartition(".")
            module_prefix, _, proj = prefix.rpartition(".")
            parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}.get(proj, (proj,))
            head = f"{module_prefix}." if module_prefix else ""
            names.update(f"{head}{p}.{leaf}" for p in parts)
        return names

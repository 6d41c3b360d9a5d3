"""The one decoder stack every family runs (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3 and, with
FusedMoE layers, the MoE families), configured by a DecoderSpec (which norms, which activation,
q/k norms, per-layer windows and rope tables, soft caps); each family's file only reads its
config into a spec. Weight names, fusing and tensor-parallel slicing: weight_loader.py.

One forward takes a flattened batch of prefill and decode tokens ([T] ids and positions, no
padding); each layer writes its new K/V through the slot mapping and attends through the block
tables with `kvserve.kernels`. With a TPGroup (tensor parallelism) each rank holds its heads, its
slice of the MLP and of the vocabulary (engine/distributed.py), and all-reduces after o_proj,
down_proj and the embedding; without one the model is the plain unsharded one, with no
collective. With a PPStage (pipeline parallelism, engine/worker/pipeline.py) it holds only its
stage's layers (the others are PPMissingLayer placeholders, as vLLM's), the embedding on the
first stage, the final norm and lm_head on the last; a stage after the first starts from the
previous stage's (hidden states, residual), and a stage before the last returns them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kvserve.engine.distributed import TPGroup, TPShape
from kvserve.engine.layers.attention import Attention, AttentionOps
from kvserve.engine.layers.layernorm import GemmaRMSNorm, RMSNorm, norm_heads
from kvserve.engine.layers.linear import empty_embedding, skip_init_linear
from kvserve.engine.layers.mlp import GatedMLP
from kvserve.engine.layers.moe import FusedMoE, MoESpec
from kvserve.engine.layers.rotary import RotaryEmbedding
from kvserve.engine.layers.vocab_embedding import VocabParallelEmbedding
from kvserve.engine.models.weight_loader import FusedWeightLoader
from kvserve.engine.worker.pipeline import PPStage
from kvserve.kernels.metadata import AttentionMetadata


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class DecoderDims:
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


@dataclass(frozen=True)
class DecoderSpec:
    """The layer choices of one family, read from its config."""

    dims: DecoderDims
    gemma_norms: bool = False  # norms scale by 1 + w; extra norms after attention and MLP
    qk_norm: bool = False  # a per-head norm on q and k before RoPE
    activation: str = "silu"  # gate activation of the gated MLP: "silu" | "gelu_tanh"
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    windows: tuple[int | None, ...] = ()  # per layer; () = no layer is windowed
    rope_types: tuple[str | None, ...] = ()  # per layer: whose rope table; () = one table
    max_model_len: int | None = None  # picks LongRoPE's factor set
    moe: MoESpec | None = None  # the experts of the sparse layers
    sparse: tuple[bool, ...] = ()  # per layer: MoE (True) or the dense MLP; () = all dense
    attn_sinks: bool = False  # a learned per-head logit in each softmax's denominator (gpt-oss)

    def window(self, i: int) -> int | None:
        return self.windows[i] if self.windows else None

    def rope_type(self, i: int) -> str | None:
        return self.rope_types[i] if self.rope_types else None

    def is_sparse(self, i: int) -> bool:
        return bool(self.sparse) and self.sparse[i]

    def norm(self, dim: int, dtype, device) -> nn.Module:
        cls = GemmaRMSNorm if self.gemma_norms else RMSNorm
        return cls(dim, self.dims.eps, dtype, device)


def decoder_dims(config) -> DecoderDims:
    """The shapes (the activation is the spec's business): q/k/v/o biases with attention_bias,
    MLP biases with mlp_bias."""
    heads = config.num_attention_heads
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderDims(
        hidden=config.hidden_size, intermediate=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size, eps=config.rms_norm_eps, qkv_bias=bias, o_bias=bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, i: int, s: TPShape, tp: TPGroup | None, dtype,
                 device=None) -> None:
        super().__init__()
        d = spec.dims
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, d.head_dim
        self.q_size, self.kv_size = s.num_heads * d.head_dim, s.num_kv_heads * d.head_dim
        self.tp, self.rope_type = tp, spec.rope_type(i)
        self.qkv_proj = skip_init_linear(d.hidden, self.q_size + 2 * self.kv_size, d.qkv_bias,
                                         dtype, device)
        self.o_proj = skip_init_linear(self.q_size, d.hidden, d.o_bias, dtype, device)
        if spec.qk_norm:
            self.q_norm = spec.norm(d.head_dim, dtype, device)
            self.k_norm = spec.norm(d.head_dim, dtype, device)
        self.attn = Attention(s.num_heads, s.num_kv_heads, d.head_dim,
                              spec.attn_scale or d.head_dim ** -0.5,
                              sliding_window=spec.window(i), logits_soft_cap=spec.attn_soft_cap,
                              sinks=spec.attn_sinks, dtype=dtype, device=device)

    def forward(self, x: Tensor, rotary: RotaryEmbedding, rope: tuple[Tensor, Tensor],
                kv_cache: tuple[Tensor, Tensor], attn: AttentionMetadata,
                attn_ops: AttentionOps) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = norm_heads(self.q_norm, q), norm_heads(self.k_norm, k)
        if rotary.rotary_dim == rotary.head_dim:  # rotated by the attention (in the KV write)
            out = self.attn(q, k, v, kv_cache, attn, attn_ops, rope)
        else:  # partial rotary dims: rotated here
            q, k = rotary.rotate(q, k, rope)
            out = self.attn(q, k, v, kv_cache, attn, attn_ops)
        out = self.o_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)  # row parallel


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, i: int, s: TPShape, tp: TPGroup | None, dtype,
                 device=None) -> None:
        super().__init__()
        hidden = spec.dims.hidden
        self.self_attn = DecoderAttention(spec, i, s, tp, dtype, device)
        self.mlp = FusedMoE(spec.moe, tp, dtype, device) if spec.is_sparse(i) else \
            GatedMLP(hidden, s.intermediate, spec.dims.mlp_bias, tp, dtype, device,
                     activation=spec.activation)
        self.input_layernorm = spec.norm(hidden, dtype, device)
        self.post_attention_layernorm = spec.norm(hidden, dtype, device)
        if spec.gemma_norms:  # sandwich: norm after attention, and before and after the MLP
            self.pre_feedforward_layernorm = spec.norm(hidden, dtype, device)
            self.post_feedforward_layernorm = spec.norm(hidden, dtype, device)

    def forward(self, x: Tensor, residual: Tensor | None, rotary: RotaryEmbedding,
                rope: tuple[Tensor, Tensor], kv_cache: tuple[Tensor, Tensor],
                attn: AttentionMetadata, attn_ops: AttentionOps) -> tuple[Tensor, Tensor]:
        """(this layer's output, the residual stream before it): the next layer, or the final
        norm, adds the two in its fused add + norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, rope, kv_cache, attn, attn_ops)
        if hasattr(self, "pre_feedforward_layernorm"):
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h),
                                                         residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class PPMissingLayer(nn.Module):
    """A part another pipeline stage holds (a layer, the embedding, the final norm)."""

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003 - never called
        raise RuntimeError("this pipeline stage does not hold that part of the model")


class DecoderModel(nn.Module):
    def __init__(self, config, spec: DecoderSpec, s: TPShape, tp: TPGroup | None, dtype,
                 device=None, pp: PPStage | None = None) -> None:
        super().__init__()
        d = spec.dims
        self.pp = pp = pp or PPStage(0, 1, 0, d.num_layers)
        if not pp.is_first:
            self.embed_tokens = PPMissingLayer()
        elif tp is None:
            self.embed_tokens = empty_embedding(d.vocab, d.hidden, dtype, device)
        else:
            self.embed_tokens = VocabParallelEmbedding(s, d.hidden, tp, dtype, device)
        # HF multiplies by the scale rounded to the model dtype (Gemma's normalizer).
        self.embed_scale = None if spec.embed_scale is None else \
            torch.tensor(spec.embed_scale, dtype=dtype).item()
        kinds = sorted({spec.rope_type(i) or "" for i in range(d.num_layers)})
        self.rotary = nn.ModuleDict({k or "all": RotaryEmbedding(
            config, d.head_dim, dtype, device, layer_type=k or None,
            max_model_len=spec.max_model_len) for k in kinds})
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, s, tp, dtype, device) if pp.holds(i) else PPMissingLayer()
            for i in range(d.num_layers))
        self.norm = spec.norm(d.hidden, dtype, device) if pp.is_last else PPMissingLayer()
        # Called with j before layer j's attention where set (a KV connector's
        # wait_for_layer_load: blocks pulled from another replica land layer by layer).
        self.layer_hook: Any = None

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn: AttentionMetadata, attn_ops: AttentionOps,
                embeds: tuple[Tensor, Tensor] | None = None,
                intermediate: tuple[Tensor, Tensor] | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """Hidden states after the final norm (the last stage), else this stage's (hidden
        states, residual) for the next; `intermediate`: the previous stage's (stages > 0).
        `kv_caches[j]` is this stage's j-th layer's."""
        if kv_caches:
            attn = attn_ops.prepare(attn, kv_caches[0][0].shape[1])
        residual = None
        if intermediate is not None:
            x, residual = intermediate
        else:
            x = self._embed(input_ids, embeds)
        ropes = {k: rot(positions) for k, rot in self.rotary.items()}  # once per step
        layers = self.layers[self.pp.start:self.pp.end]
        hook = self.layer_hook
        for j, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if hook is not None:
                hook(j)
            kind = layer.self_attn.rope_type or "all"
            x, residual = layer(x, residual, self.rotary[kind], ropes[kind], kv_cache,
                                attn.for_layer(j), attn_ops)
        if not self.pp.is_last:
            return x, residual
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]

    def _embed(self, input_ids: Tensor, embeds: tuple[Tensor, Tensor] | None) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if embeds is not None:  # prompt embeddings replace the (scaled) lookups, as in HF
            rows, values = embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        return x


class DecoderForCausalLM(FusedWeightLoader, nn.Module):
    """A family's causal LM over a paged KV cache (the interface ModelRunner uses):
    `spec_from_config` (in the family's file) says which layers."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | None = None,
                 tp: TPGroup | None = None, max_model_len: int | None = None,
                 pp: PPStage | None = None) -> None:
        super().__init__()
        self.config, self.dtype, self.tp, self.pp = config, dtype, tp, pp
        self.spec = spec = self.spec_from_config(config, max_model_len)
        self.dims = d = spec.dims
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.shard = s = TPShape.of(rank, size, d.num_heads, d.num_kv_heads, d.intermediate,
                                    d.vocab)
        self.model = DecoderModel(config, spec, s, tp, dtype, device, pp)
        first, last = self.model.pp.is_first, self.model.pp.is_last
        # A tied head shares the embedding where one stage holds both; a last stage without
        # the embedding loads the embedding's tensor into its own lm_head (stage_weights).
        self.tied_head = d.tie_embeddings and first and last
        self.lm_head = skip_init_linear(d.hidden, s.vocab_per_rank, False, dtype, device) \
            if last else PPMissingLayer()
        if self.tied_head:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._ops: AttentionOps | None = None

    @classmethod
    def spec_from_config(cls, config, max_model_len: int | None) -> DecoderSpec:
        raise NotImplementedError

    @property
    def max_position(self) -> int:
        """Longest position the rope tables cover (an upper bound for max_model_len)."""
        return min(rot.max_len for rot in self.model.rotary.values())

    def stage_weights(self, weights: Iterable[tuple[str, Tensor]]
                      ) -> Iterator[tuple[str, Tensor]]:
        """The checkpoint tensors this pipeline stage holds (all of them without stages): its
        layers', the embedding on the first stage, the final norm and lm_head on the last (a
        tied head on a last stage without the embedding takes the embedding's tensor)."""
        pp = self.model.pp
        for name, tensor in weights:
            if m := _LAYER.match(name):
                if pp.holds(int(m[1])):
                    yield name, tensor
            elif name.startswith("model.embed_tokens."):
                if pp.is_first:
                    yield name, tensor
                if pp.is_last and not pp.is_first and self.dims.tie_embeddings:
                    yield "lm_head." + name.rpartition(".")[2], tensor
            elif name.startswith(("model.norm.", "lm_head.")):
                if pp.is_last:
                    yield name, tensor
            else:
                yield name, tensor

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                attn: AttentionMetadata, embeds: tuple[Tensor, Tensor] | None = None,
                intermediate: tuple[Tensor, Tensor] | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """[T] token ids and positions -> hidden states [T, hidden] after the final norm.
        `embeds` (rows [E], values [E, hidden]): prompt embeddings that replace the embedded
        ids of those rows (vLLM's prompt embeds; replicated on every tensor-parallel rank)."""
        if self._ops is None:
            self._ops = AttentionOps.resolve()
        return self.model(input_ids, positions, kv_caches, attn, self._ops, embeds,
                          intermediate)

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """[S, hidden] -> logits [S, vocab] in the model's dtype; the sampler widens them to
        float32 for every stage but a plain greedy argmax, which needs no copy. Tensor parallel:
        each rank's vocabulary slice is gathered to rank 0; the other ranks get None. Then the
        final soft cap, if the family has one (Gemma 2): c * tanh(logits / c)."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.dims.vocab)
        cap = self.spec.final_soft_cap
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

"""What sizing needs of a model, read from its config.json (a plain dict, any family): KV heads,
head_dim, layer groups (full vs sliding-window attention) and a parameter count (MoE experts
included) for when no weight files are readable. Pure: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.engine.sizing.memory import LayerGroup

Config = dict[str, Any]


def text_config(config: Config) -> Config:
    """The language model's part of a config (multimodal Gemma 3 nests it as `text_config`)."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def head_dim(c: Config) -> int:
    """Explicit `head_dim` (Qwen3, Gemma, gpt-oss), else hidden_size / num_attention_heads."""
    return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def kv_heads(c: Config) -> int:
    return int(c.get("num_key_value_heads") or c["num_attention_heads"])


def _sliding_flags(c: Config) -> list[bool]:
    """Per layer: does it attend through a sliding window? transformers' own rules per family."""
    n, window = c["num_hidden_layers"], c.get("sliding_window")
    if c.get("layer_types"):  # Gemma 2/3, gpt-oss, Qwen2/3 in transformers >= 4.53
        return [t == "sliding_attention" for t in c["layer_types"]][:n]
    model_type = c.get("model_type", "")
    if not window:
        return [False] * n
    if model_type == "gemma2":  # even layers slide
        return [i % 2 == 0 for i in range(n)]
    if model_type.startswith("gemma3"):  # every `pattern`-th layer is global
        pattern = c.get("sliding_window_pattern", 6)
        return [(i + 1) % pattern != 0 for i in range(n)]
    if "use_sliding_window" in c:  # Qwen2/Qwen3 family: off unless asked, from max_window_layers
        first = c.get("max_window_layers", 0) if c["use_sliding_window"] else n
        return [i >= first for i in range(n)]
    return [True] * n  # Mistral, Mixtral, Phi-3: `sliding_window` applies to every layer


def layer_groups(config: Config) -> tuple[LayerGroup, ...]:
    """Layers by attention kind: one group of full-attention layers, one per window size."""
    c = text_config(config)
    flags = _sliding_flags(c)
    window = c.get("sliding_window")
    full = flags.count(False)
    groups = [LayerGroup(full, None)] if full else []
    if any(flags):
        groups.append(LayerGroup(flags.count(True), int(window)))
    return tuple(groups)


@dataclass(frozen=True)
class MoEShape:
    num_experts: int
    experts_per_token: int
    expert_intermediate: int
    shared_intermediate: int  # 0: no shared expert


def moe_shape(c: Config) -> MoEShape | None:
    """Mixtral / gpt-oss (num_local_experts), Qwen2/3-MoE (num_experts), or None if dense."""
    experts = c.get("num_local_experts") or c.get("num_experts") or 0
    if not experts:
        return None
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    return MoEShape(int(experts), int(c.get("num_experts_per_tok") or c.get(
        "experts_per_token") or 2), int(inter), int(c.get("shared_expert_intermediate_size") or 0))


def _attention_params(c: Config) -> int:
    hidden, heads, kvh, hd = c["hidden_size"], c["num_attention_heads"], kv_heads(c), head_dim(c)
    q_out, kv_out = heads * hd, kvh * hd
    params = hidden * (q_out + 2 * kv_out) + q_out * hidden
    if c.get("model_type") in ("qwen2", "qwen2_moe"):  # q/k/v biases, none on o_proj
        params += q_out + 2 * kv_out
    elif c.get("attention_bias"):  # Llama-style: every projection biased
        params += q_out + 2 * kv_out + hidden
    if c.get("model_type", "").startswith(("qwen3", "gemma3")):
        params += 2 * hd  # q_norm, k_norm
    if c.get("model_type") == "gpt_oss":
        params += heads  # attention sinks
    return params


def _mlp_params(c: Config, layer: int) -> int:
    hidden, moe = c["hidden_size"], moe_shape(c)
    dense = 3 * hidden * c["intermediate_size"]
    if moe is None or layer in (c.get("mlp_only_layers") or []) or \
            (layer + 1) % (c.get("decoder_sparse_step") or 1) != 0:
        return dense
    bias = c.get("model_type") == "gpt_oss"  # biased experts and router
    experts = moe.num_experts * (3 * hidden * moe.expert_intermediate
                                 + (2 * moe.expert_intermediate + hidden if bias else 0))
    router = hidden * moe.num_experts + (moe.num_experts if bias else 0)
    shared = 3 * hidden * moe.shared_intermediate + hidden if moe.shared_intermediate else 0
    return experts + router + shared


def parameter_count(config: Config) -> int:
    """Parameters of a decoder-only model from its config alone (every expert counted; the
    lm_head once when tied). Used where no weight files can be read (the offline catalog)."""
    c = text_config(config)
    hidden, n, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    norms = (4 if c.get("model_type", "").startswith("gemma") else 2) * hidden
    per_layer = sum(_attention_params(c) + _mlp_params(c, i) + norms for i in range(n))
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return embeddings + per_layer + hidden  # + the final norm


def active_parameter_count(config: Config) -> int:
    """Parameters one token reads: an MoE layer's top-k experts instead of all of them (the
    decode-latency bound reads these from memory); the dense count for a dense model."""
    c = text_config(config)
    moe = moe_shape(c)
    if moe is None:
        return parameter_count(config)
    top = moe.experts_per_token
    return parameter_count({**c, "text_config": None, "num_local_experts": top,
                            "num_experts": top})

"""The memory budget: how many KV blocks fit, shared by the engine and the operator's sizing.

    kv_bytes        = total_mem * gpu_memory_utilization - weight_bytes - activation_peak
    bytes_per_block = 2 * layers * kv_heads * head_dim * dtype_bytes * block_size
    num_blocks      = kv_bytes // bytes_per_block
    max_concurrency = num_blocks * block_size // tokens_per_request

With tensor parallelism over N devices every term is one rank's: weight_bytes = the model's / N,
kv_heads = the rank's KV heads (max(kv_heads / N, 1): replicated when N > kv_heads), and the
activation peak of a rank's slice of the MLP and heads (plus the full logits on the driver). Every
rank gets the same number of blocks, each holding its heads' share of every block.

Sliding-window layers (Gemma 2/3, gpt-oss, Mistral) never need more than their window: per layer
group, a request of T tokens holds `min(ceil(T / block_size), ceil((W - 1) / block_size) + 1)`
blocks of a W-token window layer (the window, plus the block the oldest token straddles), so
`max_concurrency_windowed` counts KV bytes per layer group; `max_concurrency` is without capping.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.engine.errors import ConfigError

GiB = 1 << 30

# Bytes per element of each KV-cache / weight dtype spelling users may pass.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "float8_e4m3fn": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ("bfloat16", "fp8", ...); ConfigError if unknown."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ConfigError(f"unknown dtype {dtype!r}; use one of: {known}") from None


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype_bytes: int,
                    block_size: int) -> int:
    """K and V of `block_size` tokens in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * kv_dtype_bytes * block_size


def kv_cache_bytes(total_mem: int, gpu_memory_utilization: float, weight_bytes: int,
                   activation_peak: int) -> int:
    """Bytes left for the KV cache once weights and the activation peak are paid for."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(total_mem * gpu_memory_utilization) - weight_bytes - activation_peak


def activation_peak_bytes(hidden_size: int, intermediate_size: int, vocab_size: int,
                          num_heads: int, head_dim: int, max_num_batched_tokens: int,
                          max_num_seqs: int, act_dtype_bytes: int,
                          tensor_parallel_size: int = 1) -> int:
    """A conservative estimate of one forward pass's transient memory (on one rank).

    The peak is the larger of the MLP (gate + up + act of `max_num_batched_tokens` tokens, plus the
    residual stream and q/k/v) and the logits of the sequences sampled in one step (fp32). With N
    ranks the MLP and heads are a rank's 1/N; the logits stay whole: rank 0 gathers and samples.
    """
    tokens, n = max_num_batched_tokens, tensor_parallel_size
    mlp = tokens * (3 * intermediate_size // n + 4 * hidden_size + 3 * num_heads // n * head_dim)
    logits = max_num_seqs * vocab_size * 4 * 2  # logits + softmax copy, fp32
    return mlp * act_dtype_bytes + logits


@dataclass(frozen=True)
class LayerGroup:
    """Layers that cache alike: `window` None for full attention, else the sliding window."""

    num_layers: int
    window: int | None = None


def group_blocks(tokens: int, block_size: int, window: int | None) -> int:
    """Blocks one layer of a group holds for a request of `tokens` tokens."""
    full = -(-tokens // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1) // block_size) + 1)


def request_kv_bytes(groups: tuple[LayerGroup, ...], tokens: int, block_size: int,
                     num_kv_heads: int, head_dim: int, kv_dtype_bytes: int,
                     windowed: bool = True) -> int:
    """KV bytes one request of `tokens` tokens holds over every layer group (one rank's heads);
    windowed=False: as if every layer kept all its tokens."""
    per_layer_block = 2 * num_kv_heads * head_dim * kv_dtype_bytes * block_size
    return sum(g.num_layers * per_layer_block
               * group_blocks(tokens, block_size, g.window if windowed else None)
               for g in groups)


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    activation_peak_bytes: int
    kv_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    tokens_per_request: int
    max_concurrency: int
    max_concurrency_windowed: int = 0  # with sliding layers capped at their window

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens "
                f"({self.bytes_per_block / 1024:.1f} KiB/block, {self.kv_bytes / GiB:.2f} GiB); "
                f"max concurrency {self.max_concurrency} requests of {self.tokens_per_request} "
                f"tokens" + (f" ({self.max_concurrency_windowed} with sliding layers capped "
                             "at their window)"
                             if self.max_concurrency_windowed > self.max_concurrency else ""))


def plan_memory(*, total_bytes: int, gpu_memory_utilization: float, weight_bytes: int,
                activation_peak: int, num_layers: int, num_kv_heads: int, head_dim: int,
                kv_dtype_bytes: int, block_size: int, tokens_per_request: int,
                layer_groups: tuple[LayerGroup, ...] | None = None) -> MemoryBudget:
    """Apply the budget formula; a negative KV budget yields 0 blocks (the caller decides).
    `layer_groups` (default: every layer full attention) adds the window-capped concurrency."""
    kv = kv_cache_bytes(total_bytes, gpu_memory_utilization, weight_bytes, activation_peak)
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, kv_dtype_bytes, block_size)
    num_blocks = max(kv, 0) // per_block
    tokens = max(tokens_per_request, 1)
    concurrency = num_blocks * block_size // tokens
    windowed = concurrency
    if layer_groups and any(g.window is not None for g in layer_groups):
        windowed = max(kv, 0) // request_kv_bytes(layer_groups, tokens, block_size,
                                                  num_kv_heads, head_dim, kv_dtype_bytes)
    return MemoryBudget(
        total_bytes=total_bytes, gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weight_bytes, activation_peak_bytes=activation_peak, kv_bytes=kv,
        bytes_per_block=per_block, block_size=block_size, num_blocks=num_blocks,
        tokens_per_request=tokens_per_request,
        max_concurrency=concurrency, max_concurrency_windowed=windowed,
    )


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each rank caches: its share, or one replicated head when N > kv_heads."""
    return max(num_kv_heads // tensor_parallel_size, 1)


def rank_weight_bytes(weight_bytes: int, tensor_parallel_size: int) -> int:
    """One rank's share of the weights (rounded up; the replicated norms are noise)."""
    return -(-weight_bytes // tensor_parallel_size)


def blocks_for_bytes(kv_bytes: int, per_block: int) -> int:
    """Blocks that fit in an explicit byte budget (CPU `kv_cache_memory`, `swap_space`)."""
    return max(kv_bytes, 0) // per_block


def default_max_num_batched_tokens(max_model_len: int, enable_chunked_prefill: bool = True) -> int:
    """Tokens one step may hold when the user sets none: at least 2048, up to 8192 (or, without
    chunked prefill, a whole prompt of max_model_len)."""
    tokens = max(2048, min(max_model_len, 8192))
    return tokens if enable_chunked_prefill else max(tokens, max_model_len)

"""SwapCostModel: whether moving a preempted sequence's KV to the CPU pool and back is cheaper than
recomputing it, from two rates the engine measures as it runs (preemption_mode "auto").

    swap seconds      = 2 x blocks x bytes_per_block / copy bytes per second   (out, then back in)
    recompute seconds = computed tokens / prefill tokens per second

Both rates are moving averages of what this engine saw: the copy rate from a probe at start and
then every swap, offload and restore; the prefill rate from prefill-heavy steps. Until a rate is
known the model prefers swap: a copy is a memcpy, a recompute is a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

_ALPHA = 0.2  # weight of the newest observation in the moving averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


@dataclass
class SwapCostModel:
    bytes_per_block: int  # all ranks together
    copy_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.copy_bytes_per_s = _ema(self.copy_bytes_per_s, num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = _ema(self.prefill_tokens_per_s, num_tokens / seconds)

    def swap_seconds(self, num_blocks: int) -> float | None:
        if not self.copy_bytes_per_s:
            return None
        return 2 * num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float | None:
        if not self.prefill_tokens_per_s:
            return None
        return num_tokens / self.prefill_tokens_per_s

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        swap, recompute = self.swap_seconds(num_blocks), self.recompute_seconds(num_tokens)
        if swap is None or recompute is None:
            return True
        return swap < recompute

    def crossover_tokens_per_block(self) -> float | None:
        """Computed tokens per block above which swapping wins (block_size is the most a block
        holds, so a figure above it means recompute always wins)."""
        swap = self.swap_seconds(1)
        if swap is None or not self.prefill_tokens_per_s:
            return None
        return swap * self.prefill_tokens_per_s

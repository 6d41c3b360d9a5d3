"""kvserve.kernels: paged attention and KV-cache writes (Triton on GPU, torch on CPU, a reference)."""

from kvserve.kernels.attention import paged_attention
from kvserve.kernels.cache import write_kv
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.plan import AttentionPlan, plan_attention

__all__ = ["AttentionMetadata", "AttentionPlan", "KernelInputError", "paged_attention",
           "plan_attention", "write_kv"]

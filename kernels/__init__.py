"""kvserve.kernels: paged attention and KV-cache writes (Triton on GPU, torch on CPU, reference)."""

from kvserve.kernels.attention import paged_attention
from kvserve.kernels.cache import write_kv
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.fp8 import FP8_DTYPE, compute_kv_scale
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.plan import AttentionPlan, plan_attention

__all__ = ["FP8_DTYPE", "AttentionMetadata", "AttentionPlan", "KernelInputError",
           "compute_kv_scale", "paged_attention", "plan_attention", "write_kv"]

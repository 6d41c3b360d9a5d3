"""KV-cache sizing at start-up: the whole server's memory plan on this host (checked before
anything is allocated), one rank's device budget (CUDA: profiled; CPU: an explicit or safe byte
budget), the budget in pages of the model's KV-cache groups, and the swap and host-tier pools.
The arithmetic itself is engine/sizing/ (torch-free, shared with the operator)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.kv_cache_groups import KVCacheGroups
from kvserve.engine.errors import ConfigError, OutOfKVCacheError
from kvserve.engine.sizing.host_memory import (HostPlan, available_memory, default_cpu_kv_bytes,
                                               plan_host, split)
from kvserve.engine.sizing.memory import (GiB, MemoryBudget, activation_peak_bytes,
                                          blocks_for_bytes, bytes_per_block,
                                          default_max_num_batched_tokens, kv_heads_per_rank,
                                          plan_memory, rank_weight_bytes)
from kvserve.engine.sizing.model_shape import layer_groups
from kvserve.kernels.fp8 import FP8_DTYPE

logger = logging.getLogger("kvserve.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    return DTYPES[name]


def model_shape(cfg: Any) -> tuple[int, int, int]:
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def host_plan(config: EngineConfig, model_path: Path | str, device: torch.device,
              dtype: torch.dtype) -> HostPlan | None:
    """The whole server's memory plan on this host, checked against the memory available
    (HostMemoryError naming the arithmetic and the flag); None for a CPU dry run of a GPU plan
    (KVSERVE_DEVICE_MEMORY), whose "device" is not this host's RAM."""
    if device.type == "cpu" and os.environ.get("KVSERVE_DEVICE_MEMORY"):
        return None
    from kvserve.engine.worker.model_loader import load_config

    cfg = load_config(model_path, config.revision, config.trust_remote_code, config.hf_overrides)
    n = config.world_size  # every rank of the replica (pipeline stages too) takes its share
    env = os.environ.get("KVSERVE_HOST_MEMORY")
    available = available_memory(override=int(float(env)) if env else None)
    on_cpu = device.type == "cpu"
    kv = 0
    if on_cpu:
        kv = split(_cpu_kv_budget(config, available.bytes), n)
        if config.num_gpu_blocks_override:
            layers, kv_heads, head_dim = model_shape(cfg)
            kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
            kv = config.num_gpu_blocks_override * bytes_per_block(
                layers, kv_heads_per_rank(kv_heads, n), head_dim,
                torch.finfo(kv_dtype).bits // 8, config.block_size)
    plan = plan_host(ranks=n, on_cpu=on_cpu,
                     weight_bytes=_checkpoint_weight_bytes(model_path, cfg, dtype) if on_cpu else 0,
                     activation_bytes=_activation_bytes(config, cfg, dtype) if on_cpu else 0,
                     kv_bytes=kv,
                     swap_bytes=int(config.swap_space * GiB)
                     if config.preemption_mode != "recompute" else 0,
                     host_tier_bytes=int(config.kv_offloading_size * GiB))
    logger.info("memory plan: %s; available: %.2f GiB (%s)", plan.describe(),
                available.bytes / GiB, available.source)
    plan.check(available)
    return plan


def _checkpoint_weight_bytes(model_path: Path | str, cfg: Any, dtype: torch.dtype) -> int:
    """The whole model's resident weight bytes before loading it: the checkpoint's safetensors
    headers, else our model built on the meta device."""
    from kvserve.engine.sizing.weights_size import CheckpointReadError, local_checkpoint

    if Path(model_path).is_dir():
        try:
            return local_checkpoint(model_path).weights.resident_bytes(
                torch.finfo(dtype).bits // 8)
        except CheckpointReadError:
            pass
    from kvserve.engine.models import model_class_for

    whole = model_class_for(cfg)(cfg, dtype=dtype, device=torch.device("meta"))
    return sum(p.numel() * p.element_size() for p in whole.parameters())


def _activation_bytes(config: EngineConfig, cfg: Any, dtype: torch.dtype) -> int:
    """One rank's activation peak, from the config alone (as _plan charges it)."""
    _, _, head_dim = model_shape(cfg)
    model_max = getattr(cfg, "max_position_embeddings", None) or 2048
    batched = config.max_num_batched_tokens or default_max_num_batched_tokens(
        config.max_model_len or model_max, config.enable_chunked_prefill)
    return activation_peak_bytes(
        cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size), cfg.vocab_size,
        cfg.num_attention_heads, head_dim, batched, config.max_num_seqs,
        torch.finfo(dtype).bits // 8, tensor_parallel_size=config.tensor_parallel_size)


def _cpu_kv_budget(config: EngineConfig, available: int) -> int:
    """The whole server's CPU KV cache: kv_cache_memory, $KVSERVE_KV_CACHE_MEMORY, or a safe
    share of the memory available (host_memory.default_cpu_kv_bytes)."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory)
    env = os.environ.get("KVSERVE_KV_CACHE_MEMORY")
    if env:
        return int(float(env))
    return default_cpu_kv_bytes(available)


def kv_cache_groups(model: torch.nn.Module, num_layers: int,
                    disabled: bool = False) -> KVCacheGroups:
    """The KV-cache groups of a loaded model, from the windows its attention layers pass to
    the kernels (so blocks are released only where the kernels really slide)."""
    from kvserve.engine.layers.attention import Attention

    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    if disabled or len(windows) != num_layers:  # one table; no wrapper: full attention
        return KVCacheGroups.single(num_layers)
    return KVCacheGroups.from_windows(windows)


def page_budget(budget: MemoryBudget, groups: KVCacheGroups, num_layers: int,
                override: int | None = None,
                request: tuple[int, int] | None = None) -> MemoryBudget:
    """The budget in pages: with several groups a block holds `page_layers` layers, not all,
    so the same KV bytes make num_layers / page_layers times as many blocks
    (num_gpu_blocks_override counts pages, as vLLM's). `request` (tokens per request, tokens a
    step) sets the window-capped concurrency from the blocks the manager spends (pages padded)."""
    if groups.page_layers != num_layers:
        per_page = budget.bytes_per_block * groups.page_layers // num_layers
        pages = override or blocks_for_bytes(budget.kv_bytes, per_page)
        budget = replace(budget, bytes_per_block=per_page, num_blocks=pages,
                         kv_bytes=max(budget.kv_bytes, pages * per_page))
    if groups.slides and request is not None:
        need = groups.blocks_for(request[0], budget.block_size, request[1])
        budget = replace(budget, max_concurrency_windowed=budget.num_blocks // need)
    return budget


def host_pools(config: EngineConfig, budget: MemoryBudget,
                host: HostPlan | None = None) -> tuple[int, int]:
    """Blocks of the swap pool (swap_space, all ranks together, never more than the device
    holds: a swapped sequence came from there) and of the host tier (kv_offloading_size, all
    ranks together): this rank's share of each."""
    per_block = budget.bytes_per_block  # this rank's
    n = config.world_size
    cpu_blocks = 0
    if config.preemption_mode != "recompute":
        cpu_blocks = min(blocks_for_bytes(split(int(config.swap_space * GiB), n), per_block),
                         budget.num_blocks)
    host_bytes = split(int(config.kv_offloading_size * GiB), n)
    host_blocks = blocks_for_bytes(host_bytes, per_block) if host_bytes else 0
    if config.kv_offloading_size and host_blocks < 1:
        raise ConfigError(f"kv_offloading_size {config.kv_offloading_size} GiB holds no KV "
                          f"block of {per_block} bytes per rank; raise it")
    return cpu_blocks, host_blocks


def device_budget(config: EngineConfig, cfg: Any, model: torch.nn.Module,
                  device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, batched: int,
                  max_len: int, shape: tuple[int, int, int],
                  host: HostPlan | None = None) -> MemoryBudget:
    """One rank's memory budget: CUDA's free memory x utilisation, a CPU dry run's
    KVSERVE_DEVICE_MEMORY, or on a CPU the host plan's KV bytes (num_gpu_blocks_override wins)."""
    layers, kv_heads, head_dim = shape  # kv_heads: this rank's
    tp = config.tensor_parallel_size
    kv_bytes_el = torch.finfo(kv_dtype).bits // 8
    weights = _weight_bytes(model, cfg, dtype, tp)
    width = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    act = activation_peak_bytes(cfg.hidden_size, width, cfg.vocab_size, cfg.num_attention_heads,
                                head_dim, batched, config.max_num_seqs,
                                torch.finfo(dtype).bits // 8, tensor_parallel_size=tp)
    device_memory = os.environ.get("KVSERVE_DEVICE_MEMORY")
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        util = config.gpu_memory_utilization
    elif device_memory:  # a CPU dry run of a GPU plan: each rank as a device of this size
        total, util = int(float(device_memory)), config.gpu_memory_utilization
    else:
        kv = host.kv_bytes if host is not None else split(_cpu_kv_budget(
            config, available_memory().bytes), config.world_size)
        total = kv + weights + act
        util = 1.0
    budget = plan_memory(total_bytes=total, gpu_memory_utilization=util, weight_bytes=weights,
                         activation_peak=act, num_layers=layers, num_kv_heads=kv_heads,
                         head_dim=head_dim, kv_dtype_bytes=kv_bytes_el,
                         block_size=config.block_size, tokens_per_request=max_len,
                         layer_groups=layer_groups(cfg.to_dict()))
    if config.num_gpu_blocks_override:
        budget = plan_memory(
            total_bytes=weights + act + config.num_gpu_blocks_override * budget.bytes_per_block,
            gpu_memory_utilization=1.0, weight_bytes=weights, activation_peak=act,
            num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
            kv_dtype_bytes=kv_bytes_el, block_size=config.block_size, tokens_per_request=max_len)
    if budget.num_blocks < 1:
        raise OutOfKVCacheError(
            f"no memory left for the KV cache: {budget.describe()}; weights take "
            f"{weights / GiB:.2f} GiB. Raise gpu_memory_utilization / kv_cache_memory or use a "
            "smaller model")
    return budget


def _weight_bytes(model: torch.nn.Module, cfg: Any, dtype: torch.dtype, tp: int) -> int:
    """Weight bytes one rank is charged: the loaded model's, or with N ranks the whole model's
    / N (rounded up), the same convention as the operator's sizing. The unsharded model is
    built on the meta device to count it, so no rank ever holds it."""
    if tp == 1:
        return resident_weight_bytes(model)
    whole = type(model)(cfg, dtype=dtype, device=torch.device("meta"))
    return rank_weight_bytes(sum(p.numel() * p.element_size() for p in whole.parameters()), tp)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a loaded model holds: its parameters, plus the CPU's oneDNN-packed
    linears and the quantised linears' kernels (and stacked quantised experts), which hold their
    weights as buffers (a tied lm_head packed as its own copy counts again)."""
    from kvserve.engine.layers.moe_gpu import StackedExperts
    from kvserve.engine.layers.packed_linear import PackedLinear
    from kvserve.engine.layers.quantization import QuantLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += sum(b.numel() * b.element_size()
                         for b in (module.packed_weight, module.bias) if b is not None)
        elif isinstance(module, QuantLinear) and module.kernel is not None:
            total += sum(_tensor_bytes(b) for b in module.kernel.buffers())
        elif isinstance(module, StackedExperts):  # an MoE layer's quantised experts, on a GPU
            total += sum(_tensor_bytes(b) for b in module.buffers())
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a buffer; oneDNN's prepacked int8 weight is opaque, counted as int8 codes."""
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return t.untyped_storage().nbytes()

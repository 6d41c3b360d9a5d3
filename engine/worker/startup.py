"""Engine start-up: seed, device and dtypes, torch's CPU threads, load the model, then size the
KV cache (worker/kv_sizing.py). With tensor_parallel_size N > 1 it first checks that N splits the
model, starts the N - 1 workers, and sizes one rank."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.kv_cache_groups import KVCacheGroups
from kvserve.engine.cpu_threads import rank_threads, warn_if_long_spin
from kvserve.engine.distributed import TPGroup, check_tensor_parallel
from kvserve.engine.errors import ConfigError
from kvserve.engine.sizing.host_memory import HostPlan
from kvserve.engine.sizing.memory import (MemoryBudget, default_max_num_batched_tokens,
                                          kv_heads_per_rank)
from kvserve.engine.worker.kv_sizing import (DTYPES, device_budget, host_plan, host_pools,
                                             kv_cache_groups, model_shape, page_budget,
                                             resolve_kv_dtype)
from kvserve.engine.worker.malloc_tuning import keep_activation_memory
from kvserve.engine.worker.workers import CacheSpec, WorkerGroup

logger = logging.getLogger("kvserve.engine")


@dataclass
class EngineSetup:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    model: torch.nn.Module
    hf_config: Any
    max_model_len: int
    max_num_batched_tokens: int
    budget: MemoryBudget
    num_cpu_blocks: int
    num_host_blocks: int  # the KV host tier (kv_offloading_size), per rank
    num_layers: int
    kv_groups: KVCacheGroups  # which layers share a block table; a block is a page of them
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: list[int]
    workers: WorkerGroup | None = None  # ranks 1..N-1 (tensor parallel)
    host_plan: HostPlan | None = None  # the whole server's memory on this host


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but no CUDA device is visible; use "
                          "device='cpu' (or 'auto')")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA, and on CPUs with native bf16 (AMX/AVX512-BF16); else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def _eos_ids(cfg: Any, model_path: Path | str) -> list[int]:
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(model_path))
        ids += [gen.eos_token_id] if isinstance(gen.eos_token_id, int) else (gen.eos_token_id or [])
    except Exception:  # noqa: BLE001 - no generation_config.json: fall back to the model config
        pass
    eos = getattr(cfg, "eos_token_id", None)
    ids += [eos] if isinstance(eos, int) else (eos or [])
    return list(dict.fromkeys(ids))


def size_torch_threads(ranks: int = 1, usable: tuple[int, str] | None = None) -> int:
    """Set this process's torch intra-op threads to its share (rank_threads) where torch would
    run more; returns the count in effect."""
    want, why = rank_threads(ranks, usable)
    have = torch.get_num_threads()
    if want < have or (ranks > 1 and want != have):
        torch.set_num_threads(want)
        logger.info("torch CPU threads: %d (was %d; %s)", want, have, why)
    return torch.get_num_threads()


def set_random_seed(seed: int | None) -> None:
    """vLLM's engine seed: Python's, numpy's and torch's global generators (what unseeded
    sampling draws from), set once at start so that a script's run repeats itself."""
    if seed is None:
        return
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_up(config: EngineConfig, model_path: Path | str,
           load_model: Callable[..., tuple[torch.nn.Module, Any]]) -> EngineSetup:
    set_random_seed(config.seed)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        keep_activation_memory()
        # the container's CPU quota, not the node's CPUs, split over the ranks (cpu_threads.py)
        size_torch_threads(config.tensor_parallel_size)
        warn_if_long_spin()
    host = host_plan(config, model_path, device, dtype)  # refused here: nothing allocated yet
    workers, tp = None, None
    if config.tensor_parallel_size > 1:
        workers, tp = _start_workers(config, model_path, dtype, device)
    try:
        setup = _set_up_rank0(config, model_path, load_model, device, dtype, tp, host)
        if workers is not None:
            workers.wait_for("ready")
            workers.init_cache(CacheSpec(
                setup.num_layers, setup.num_kv_heads, setup.head_dim, setup.budget.num_blocks,
                config.block_size, setup.kv_dtype, setup.num_cpu_blocks,
                config.attention_backend, setup.num_host_blocks, setup.kv_groups))
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    setup.workers, setup.host_plan = workers, host
    return setup


def _start_workers(config: EngineConfig, model_path: Path | str, dtype: torch.dtype,
                   device: torch.device) -> tuple[WorkerGroup, TPGroup]:
    """Refuse an N that cannot split this model (before any process starts), then start them."""
    from kvserve.engine.worker.model_loader import load_config

    n = config.tensor_parallel_size
    cfg = load_config(model_path, config.revision, config.trust_remote_code, config.hf_overrides)
    layers, kv_heads, _ = model_shape(cfg)
    check_tensor_parallel(n, cfg.num_attention_heads, kv_heads,
                          getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        width = getattr(cfg, key, None)  # each rank holds 1/N of every expert's width
        if width and width % n:
            raise ConfigError(f"tensor_parallel_size={n} does not divide {key}={width}; pick an "
                              "N that divides every expert width")
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ConfigError(f"tensor_parallel_size={n} needs {n} GPUs, this machine shows "
                          f"{torch.cuda.device_count()}")
    group, tp = WorkerGroup.start(str(model_path), config.revision, dtype, device.type, n,
                                  max_model_len=config.max_model_len,
                                  quantization=config.quantization,
                                  hf_overrides=config.hf_overrides,
                                  lora=config.lora_config(),
                                  load_format=config.load_format)
    logger.info("tensor parallel: %d ranks (%s), %d torch thread(s) per rank", n,
                "nccl" if device.type == "cuda" else "gloo", group.spec.threads)
    return group, tp


def _set_up_rank0(config: EngineConfig, model_path: Path | str,
                  load_model: Callable[..., tuple[torch.nn.Module, Any]], device: torch.device,
                  dtype: torch.dtype, tp: TPGroup | None,
                  host: HostPlan | None = None) -> EngineSetup:
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    extra: dict[str, Any] = {"tp": tp} if tp is not None else {}
    if config.max_model_len is not None:
        extra["max_model_len"] = config.max_model_len
    if config.quantization is not None:
        extra["quantization"] = config.quantization
    if config.hf_overrides is not None:
        extra["hf_overrides"] = config.hf_overrides
    if config.load_format == "sharded_state":
        extra["load_format"] = config.load_format
    model, cfg = load_model(model_path, dtype, device, revision=config.revision, **extra)
    if config.enable_lora:  # before the budget: the adapter slots' buffers are weights too
        from kvserve.lora.model import attach_lora

        attach_lora(model, config.lora_config())
    layers, kv_heads, head_dim = model_shape(cfg)
    kv_heads = kv_heads_per_rank(kv_heads, config.tensor_parallel_size)
    model_max = getattr(cfg, "max_position_embeddings", None) or 2048
    max_len = config.max_model_len or model_max
    if max_len > model_max:
        raise ConfigError(f"max_model_len {max_len} exceeds the model's context of {model_max} "
                          "tokens; lower max_model_len")
    batched = config.max_num_batched_tokens or default_max_num_batched_tokens(
        max_len, config.enable_chunked_prefill)
    groups = kv_cache_groups(model, layers, config.disable_hybrid_kv_cache_manager)
    budget = device_budget(config, cfg, model, device, dtype, kv_dtype, batched, max_len,
                   (layers, kv_heads, head_dim), host)
    budget = page_budget(budget, groups, layers, config.num_gpu_blocks_override,
                         (max_len, 1))  # decoding: sliding layers hold their window only
    cpu_blocks, host_blocks = host_pools(config, budget, host)
    return EngineSetup(device, dtype, kv_dtype, model, cfg, max_len, batched, budget, cpu_blocks,
                       host_blocks, layers, groups, kv_heads, head_dim, cfg.vocab_size,
                       _eos_ids(cfg, model_path))


__all__ = ["EngineSetup", "set_up", "resolve_device", "resolve_dtype", "set_random_seed",
           "size_torch_threads"]

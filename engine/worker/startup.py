"""Engine start-up: seed, device and dtypes, torch's CPU threads, load the model, then size the
KV cache (worker/kv_sizing.py). With tensor_parallel_size N > 1 it first checks that N splits the
model, starts the N - 1 workers, and sizes one rank. With pipeline_parallel_size P > 1 the world
is P x N ranks, the driver loads stage 0's layers only, and the block count is sized for the
stage with the most layers, so that every stage's KV cache holds the same blocks. Ranks on
other hosts come from the environment (engine/worker/rank_env.py)."""

from __future__ import annotations

import logging
import os
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
from kvserve.engine.worker.pipeline import (PPStage, StageLink, microbatches_for,
                                            partition_layers)
from kvserve.engine.worker.rank_env import RankEnv, from_environ
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
    link: StageLink | None = None  # the driver's link to stage 1 (pipeline parallel)


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
        env = from_environ() if config.world_size > 1 else RankEnv()
        size_torch_threads(env.local_ranks(config.world_size))
        warn_if_long_spin()
    host = host_plan(config, model_path, device, dtype)  # refused here: nothing allocated yet
    workers, tp, counts = None, None, ()
    if config.world_size > 1:
        workers, tp, counts = _start_workers(config, model_path, dtype, device)
    try:
        setup = _set_up_rank0(config, model_path, load_model, device, dtype, tp, host, counts)
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
    if workers is not None and config.pipeline_parallel_size > 1:
        spec = workers.spec
        setup.link = StageLink.of(0, spec.layout, setup.hf_config.hidden_size, dtype, device,
                                  spec.microbatches, via_host=spec.backend == "gloo")
    return setup


def _start_workers(config: EngineConfig, model_path: Path | str, dtype: torch.dtype,
                   device: torch.device) -> tuple[WorkerGroup, TPGroup | None, tuple[int, ...]]:
    """Refuse a layout that cannot split this model (before any process starts), then start
    the ranks; the layers of each pipeline stage too."""
    from kvserve.engine.worker.model_loader import load_config

    n, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    env = from_environ()
    cfg = load_config(model_path, config.revision, config.trust_remote_code, config.hf_overrides)
    layers, kv_heads, _ = model_shape(cfg)
    check_tensor_parallel(n, cfg.num_attention_heads, kv_heads,
                          getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    counts = tuple(partition_layers(layers, pp)) if pp > 1 else ()
    if not env.is_leader:
        raise ConfigError(f"this host is worker {env.node} of {env.nodes} ({env.source}): run "
                          "`kvserve serve --headless` here; the leader (host 0) serves the API")
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        width = getattr(cfg, key, None)  # each rank holds 1/N of every expert's width
        if width and width % n:
            raise ConfigError(f"tensor_parallel_size={n} does not divide {key}={width}; pick an "
                              "N that divides every expert width")
    local = env.local_ranks(n * pp)
    if device.type == "cuda" and torch.cuda.device_count() < local \
            and not os.environ.get("KVSERVE_RANK_DEVICES"):
        raise ConfigError(f"{local} ranks on this host (tensor_parallel_size={n} x "
                          f"pipeline_parallel_size={pp} over {env.nodes} host(s)) need {local} "
                          f"GPUs, this machine shows {torch.cuda.device_count()}")
    group, tp = WorkerGroup.start(str(model_path), config.revision, dtype, device.type, n * pp,
                                  max_model_len=config.max_model_len,
                                  quantization=config.quantization,
                                  hf_overrides=config.hf_overrides,
                                  lora=config.lora_config(),
                                  load_format=config.load_format, pp=pp, layer_counts=counts,
                                  env=env, microbatches=microbatches_for(pp) if pp > 1 else 1)
    logger.info("parallel: %d stage(s) x %d tensor-parallel rank(s)%s on %d host(s) (%s), "
                "%d torch thread(s) per rank", pp, n,
                f", layers per stage {list(counts)}, {group.spec.microbatches} micro-batch(es) "
                "per step" if counts else "", env.nodes,
                "nccl" if device.type == "cuda" else "gloo", group.spec.threads)
    return group, tp, counts


def _set_up_rank0(config: EngineConfig, model_path: Path | str,
                  load_model: Callable[..., tuple[torch.nn.Module, Any]], device: torch.device,
                  dtype: torch.dtype, tp: TPGroup | None,
                  host: HostPlan | None = None, counts: tuple[int, ...] = ()) -> EngineSetup:
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    extra: dict[str, Any] = {"tp": tp} if tp is not None else {}
    stage = PPStage(0, len(counts), 0, counts[0]) if counts else None
    if stage is not None:
        extra["pp"] = stage
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
    # every stage's cache holds the same blocks: size them for the stage with the most layers
    sized_layers = max(counts) if counts else layers
    model_max = getattr(cfg, "max_position_embeddings", None) or 2048
    max_len = config.max_model_len or model_max
    if max_len > model_max:
        raise ConfigError(f"max_model_len {max_len} exceeds the model's context of {model_max} "
                          "tokens; lower max_model_len")
    batched = config.max_num_batched_tokens or default_max_num_batched_tokens(
        max_len, config.enable_chunked_prefill)
    # Pipeline stages keep one block table for all layers (sliding layers still slide in the
    # kernels; their blocks are released with the request, not with the window).
    groups = KVCacheGroups.single(stage.num_layers) if stage is not None else \
        kv_cache_groups(model, layers, config.disable_hybrid_kv_cache_manager)
    budget = device_budget(config, cfg, model, device, dtype, kv_dtype, batched, max_len,
                           (sized_layers, kv_heads, head_dim), host)
    budget = page_budget(budget, groups, sized_layers if stage is None else
                         groups.page_layers, config.num_gpu_blocks_override,
                         (max_len, 1))  # decoding: sliding layers hold their window only
    cpu_blocks, host_blocks = host_pools(config, budget, host)
    return EngineSetup(device, dtype, kv_dtype, model, cfg, max_len, batched, budget, cpu_blocks,
                       host_blocks, stage.num_layers if stage else layers, groups, kv_heads,
                       head_dim, cfg.vocab_size, _eos_ids(cfg, model_path))


__all__ = ["EngineSetup", "set_up", "resolve_device", "resolve_dtype", "set_random_seed",
           "size_torch_threads"]

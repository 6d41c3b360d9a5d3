"""Building the engine core's parts from the start-up's `EngineSetup` (scheduler, model runner,
disk tier, logits processors, fp8 KV scales, CUDA graphs), its start-up log, and keeping the
cached blocks on the disk tier at shutdown. `core` is the `EngineCore`."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import torch
from kvserve.engine.config import EngineConfig
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_offload.disk_block_file import describe_layout
from kvserve.engine.kv_offload.disk_tier import DiskTier
from kvserve.engine.kv_offload.swap_cost import SwapCostModel
from kvserve.engine.sample.tokenizer import chat_token_ids, prompt_token_ids
from kvserve.engine.sizing.weights_size import weights_log_line
from kvserve.engine.worker.cuda_graph import eager_reason, graphs_log_line
from kvserve.engine.worker.model_runner import ModelRunner
from kvserve.kernels.backend import resolve_backend
from kvserve.engine.worker.startup import EngineSetup

logger = logging.getLogger("kvserve.engine")


def make_scheduler(config: EngineConfig, setup: EngineSetup, kv: KVCacheManager,
                   swap_cost: SwapCostModel) -> Scheduler:
    return Scheduler(SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
        preemption_mode=config.preemption_mode, policy=config.scheduling_policy,
        max_loras=config.max_loras if config.enable_lora else 0), kv, swap_cost)


def make_runner(config: EngineConfig, setup: EngineSetup, disk: DiskTier | None,
                kv_view: Any = None) -> ModelRunner:
    backend = config.attention_backend
    if kv_view is not None and resolve_backend(backend, setup.device) == "cpu":
        backend = "torch"  # the C++ CPU kernels take contiguous caches; a shared view is strided
    return ModelRunner(
        setup.model, num_layers=setup.num_layers, num_kv_heads=setup.num_kv_heads,
        head_dim=setup.head_dim, num_blocks=setup.budget.num_blocks,
        block_size=config.block_size, kv_dtype=setup.kv_dtype, device=setup.device,
        num_cpu_blocks=setup.num_cpu_blocks, attention_backend=backend,
        workers=setup.workers, num_host_blocks=setup.num_host_blocks, disk=disk,
        kv_groups=setup.kv_groups, kv_view=kv_view, link=setup.link)


def seat_setup(config: EngineConfig, setup: EngineSetup, seat: Any) -> EngineSetup:
    """The setup of a model on a shared KV pool (worker/kv_region.PoolSeat): its blocks are the
    pool's pages; the tiers and ranks that assume a pool of one's own are refused by name."""
    for flag, on in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                     ("swap_space", setup.num_cpu_blocks > 0),
                     ("kv_offloading_size", setup.num_host_blocks > 0),
                     ("enable_lora", config.enable_lora)):
        if on:
            raise ConfigError(f"{flag} is not supported for a model on a shared KV pool "
                              "(several models in one server); drop it")
    seat.shared.open(setup.budget, setup.device, config.enable_prefix_caching)
    seat.shared.pool.join(seat.member, setup.budget.bytes_per_block)
    pages = seat.shared.pool.num_pages
    budget = dataclasses.replace(setup.budget, num_blocks=pages,
                                 kv_bytes=pages * seat.shared.pool.page_bytes)
    return dataclasses.replace(setup, budget=budget)


def seat_view(setup: EngineSetup, seat: Any) -> Any:
    """The model's KV tensor over the shared region (None without a seat)."""
    if seat is None:
        return None
    return seat.shared.region.view(setup.kv_groups.page_layers, setup.budget.block_size,
                                   setup.num_kv_heads, setup.head_dim, setup.kv_dtype)


def disk_tier(config: EngineConfig, setup: EngineSetup, model_path: str) -> DiskTier | None:
    """The KV disk tier (kv_offloading_disk_path), its files named for this model and layout."""
    if not config.kv_offloading_disk_path or not setup.num_host_blocks:
        return None
    shape = (2, setup.kv_groups.page_layers, config.block_size, setup.num_kv_heads,
             setup.head_dim)
    layout = describe_layout(config.model, config.revision, str(setup.kv_dtype), shape,
                             model_path)
    return DiskTier(config.kv_offloading_disk_path,
                    int(config.kv_offloading_disk_size * (1 << 30)),
                    setup.budget.bytes_per_block, layout)


def logits_processors(config: EngineConfig, device: Any) -> Any:
    """vLLM's LLM(logits_processors=[cls | "module:Class" | "pkg.mod.Class"]), or None."""
    if not config.logits_processors:
        return None
    from kvserve.engine.sample.logits_processor import LogitsProcessor, LogitsProcessors

    classes = []
    for item in config.logits_processors:
        if isinstance(item, str):
            module, _, name = item.replace(":", ".").rpartition(".")
            item = getattr(importlib.import_module(module), name)
        if not (isinstance(item, type) and issubclass(item, LogitsProcessor)):
            raise ConfigError(f"logits_processors takes LogitsProcessor subclasses "
                              f"(kvserve.engine.sample.logits_processor), got {item!r}")
        classes.append(item)
    return LogitsProcessors(classes, config, device)


def graph_query_lens(spec: Any) -> tuple[int, ...]:
    """Tokens per sequence captured besides decode's 1: a speculative verification's 1 + k
    (`spec`: the SpeculativeConfig, None: off). None for EAGLE-3, whose head reads the
    target's inner states through layer hooks that a graph replay does not run."""
    if spec is None or spec.method == "eagle3":
        return ()
    return (1 + int(spec.num_speculative_tokens),)


def capture_decode_graphs(core: Any, capture: Any = None) -> None:
    """CUDA graphs for decode (engine/worker/cuda_graph.py). A capture that fails on any rank
    (an op of this model that syncs with the host) leaves every step of every rank eager, said
    once in the log. `capture`: the CPU tests' stand-in for CUDAGraph."""
    try:
        core.runner.capture_decode_graphs(core.config.max_num_seqs, core.max_model_len, capture,
                                          graph_query_lens(core.config.speculative_config))
    except RuntimeError as exc:
        core.runner.graphs = None
        logger.warning("CUDA graph capture failed (%s); decode runs eagerly "
                       "(--enforce-eager skips the attempt)", exc)


def calibrate_kv_scales(core: Any) -> None:
    """`calculate_kv_scales=True`: FP8 scales from a representative first batch."""
    text = ("The KV cache stores the keys and values of every token seen so far. "
            "What is the capital of France? Paris is the capital of France. 0123456789")
    try:
        ids = chat_token_ids(core.tokenizer, [{"role": "user", "content": text}])
    except Exception:  # noqa: BLE001 - a model without a chat template: plain text
        ids = prompt_token_ids(core.tokenizer, text)
    core.runner.calibrate_kv_scales(ids[: core.max_model_len], core.dtype)
    logger.info("fp8 KV scales from calibration: k_scale %.4g, v_scale %.4g",
                core.runner.k_scale, core.runner.v_scale)


def log_start(core: Any, setup: EngineSetup) -> None:
    """The start-up lines: async scheduling, budget and devices, weights, CUDA graphs (or why
    none), KV-cache groups."""
    if core.async_scheduling:
        logger.info("async scheduling: each step is launched before the previous step's "
                    "tokens are read (--no-async-scheduling turns it off)")
    logger.info("%s; device %s, dtype %s, kv dtype %s, attention backend %s",
                core.memory_budget.describe(), core.device, core.dtype, setup.kv_dtype,
                core.runner.backend)
    logger.info("%s", weights_log_line(core.model_weight_bytes, core.model_path,
                                       torch.finfo(core.dtype).bits // 8,
                                       core.config.quantization))
    if core.runner.graphs is None:  # captured graphs were logged with their sizes (model_runner)
        logger.info("%s", graphs_log_line(None, eager_reason(
            core.device.type, core.config.enforce_eager, core.runner.backend)))
    groups = core.kv.groups
    if groups.is_hybrid or groups.slides:
        logger.info("KV-cache groups: %s; a block is a page of %d layers, sliding groups "
                    "free blocks that left their window",
                    ", ".join(f"{len(g.layers)} layers "
                              f"{'W=' + str(g.sliding_window) if g.sliding_window else 'full'}"
                              for g in groups.groups), groups.page_layers)


def persist_to_disk(core: Any) -> None:
    """The host tier's and the device pool's cached blocks go to the disk tier too, so a
    restart of the same model finds whole prefixes there: their first blocks are the hottest,
    so they are rarely on disk while the engine runs."""
    host, disk = core.runner.host, core.disk
    blocks = [(h, slot, False) for h, slot in core.kv.host.slots.items()]
    blocks += [(h, b.block_id, True) for h, b in core.kv.pool.cached.items()]
    for h, index, from_device in blocks:
        if h not in disk:
            data = host.read_block(index, from_device=from_device)
            disk.put(h, bytearray(data.numpy()), wait=True)

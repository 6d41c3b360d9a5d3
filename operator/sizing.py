"""Sizing: the engine's memory budget (engine/sizing/memory.py) -> GPUs per replica, blocks,
concurrency.

GPUs per replica is the smallest power of two (tensor parallel: weights and KV heads split across
the GPUs) whose per-GPU budget holds `maxNumSeqs x maxModelLen` tokens of KV (one full-length
request when maxNumSeqs is unset). Every term is one rank's, exactly as the engine computes it with
`--tensor-parallel-size N` (engine/sizing/memory.py). A replica is one pod on one node: counts above
GPUS_PER_NODE (multi-node tensor parallelism) are refused. Pure: no Kubernetes, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.defaults import GPUS_PER_NODE, MAX_NUM_SEQS
from kvserve.engine.sizing.memory import (
    default_max_num_batched_tokens,
    GiB, MemoryBudget, activation_peak_bytes, dtype_bytes, kv_heads_per_rank, plan_memory,
    rank_weight_bytes,
)
from kvserve.engine.sizing.host_memory import cpu_kv_bytes
from kvserve.operator import offload
from kvserve.operator.catalog import ModelArch
from kvserve.operator.spec import InvalidSpecError, ServiceSpec

DEFAULT_MAX_NUM_SEQS = MAX_NUM_SEQS  # the engine's own default (EngineConfig.max_num_seqs)


def batched_tokens(max_model_len: int) -> int:
    """Tokens per step, exactly as the engine picks them (engine/sizing/memory.py)."""
    return default_max_num_batched_tokens(max_model_len)


class InsufficientGPUMemoryError(InvalidSpecError):
    """No allowed GPU count holds the weights plus the requested KV cache."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="InsufficientGPUMemory")


@dataclass(frozen=True)
class Sizing:
    gpus_per_replica: int  # 0 on cpu
    weight_bytes: int  # per replica
    kv_bytes: int  # per replica (all its GPUs)
    bytes_per_block: int  # per replica (all its GPUs' shares of one block)
    num_blocks: int
    max_concurrency: int  # full-length (maxModelLen) requests one replica holds at once
    max_concurrency_windowed: int  # the same with sliding-window layers capped at their window
    max_num_seqs: int  # what the engine is started with
    activation_peak_bytes: int  # per GPU
    device_memory_bytes: int  # per GPU (or per pod on cpu)
    weight_dtype: str
    kv_cache_dtype: str
    explanation: str
    kv_offloading: dict = field(default_factory=dict)  # offload.status: the tiers' sizes
    model_source: str = "catalog"  # catalog, spec.model.architecture, or the files read


    def as_status(self) -> dict:
        """status.sizing (also `kvserve plan --output json`)."""
        return {
            "gpusPerReplica": self.gpus_per_replica, "weightBytes": self.weight_bytes,
            "kvBytes": self.kv_bytes, "bytesPerBlock": self.bytes_per_block,
            "numBlocks": self.num_blocks, "maxConcurrency": self.max_concurrency,
            "maxConcurrencyWindowed": self.max_concurrency_windowed,
            "maxNumSeqs": self.max_num_seqs, "activationPeakBytes": self.activation_peak_bytes,
            "deviceMemoryBytes": self.device_memory_bytes, "weightDtype": self.weight_dtype,
            "kvCacheDtype": self.kv_cache_dtype, "modelSource": self.model_source,
            **({"kvOffloading": self.kv_offloading} if self.kv_offloading else {}),
            "explanation": self.explanation,
        }


def weight_dtype(spec: ServiceSpec) -> str:
    """`auto` is bfloat16 on GPUs (as the engine resolves it); float32 on CPUs, which the operator
    passes explicitly because the engine's CPU `auto` depends on the node's bf16 support."""
    if spec.engine.dtype != "auto":
        return spec.engine.dtype
    return "float32" if spec.device == "cpu" else "bfloat16"


def kv_dtype(spec: ServiceSpec) -> str:
    kv = spec.engine.kv_cache_dtype
    return weight_dtype(spec) if kv == "auto" else kv


def gpu_candidates(spec: ServiceSpec) -> list[int]:
    """Powers of two up to maxPerReplica that the engine can split the model over (heads, KV
    heads, MLP: engine/distributed.py's rule)."""
    if spec.device == "cpu":
        return [1]
    arch, out, n = spec.model.arch, [], 1
    while n <= spec.max_gpus_per_replica:
        if arch.heads % n == 0 and (arch.kv_heads % n == 0 or n % arch.kv_heads == 0) and \
                arch.intermediate % n == 0:
            out.append(n)
        n *= 2
    return out


def activation_bytes(spec: ServiceSpec, gpus: int = 1) -> int:
    """One rank's activation peak with the model split over `gpus`."""
    arch, eng = spec.model.arch, spec.engine
    return activation_peak_bytes(
        hidden_size=arch.hidden, intermediate_size=arch.intermediate, vocab_size=arch.vocab,
        num_heads=arch.heads, head_dim=arch.head_dim,
        max_num_batched_tokens=batched_tokens(eng.max_model_len),
        max_num_seqs=eng.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        act_dtype_bytes=dtype_bytes(weight_dtype(spec)), tensor_parallel_size=max(gpus, 1))


def cpu_swap_bytes(spec: ServiceSpec) -> int:
    """The swap pool a CPU pod's engine may fill (spec.engine.swapSpaceGiB): in the pod's RAM."""
    return int(spec.engine.swap_space_gib * GiB) if spec.device == "cpu" else 0


def budget_per_gpu(spec: ServiceSpec, gpus: int) -> MemoryBudget:
    """The engine's budget on each of `gpus` GPUs holding 1/gpus of the weights and KV heads.
    On a CPU pod, the engine's host plan (engine/sizing/host_memory.py): the pod's memory x
    utilisation holds weights, activations, the KV cache and the swap pool (at most the KV
    cache); the host tier comes on top of the user's limit (offload.py)."""
    arch, eng = spec.model.arch, spec.engine
    weights = arch.weight_bytes(dtype_bytes(weight_dtype(spec)))
    total, util = spec.gpu_memory_bytes, eng.gpu_memory_utilization
    if spec.device == "cpu":
        act = activation_bytes(spec, gpus)
        kv = cpu_kv_bytes(available_bytes=int(total * util), ranks=1, weight_bytes=weights,
                          activation_bytes=act, swap_bytes=cpu_swap_bytes(spec),
                          host_tier_bytes=0)
        total, util = weights + act + kv, 1.0
    return plan_memory(
        total_bytes=total, gpu_memory_utilization=util,
        weight_bytes=rank_weight_bytes(weights, gpus), activation_peak=activation_bytes(spec, gpus),
        num_layers=arch.layers, num_kv_heads=kv_heads_per_rank(arch.kv_heads, gpus),
        head_dim=arch.head_dim, kv_dtype_bytes=dtype_bytes(kv_dtype(spec)),
        block_size=eng.block_size, tokens_per_request=eng.max_model_len,
        layer_groups=arch.layer_groups or None)


def blocks_needed(spec: ServiceSpec) -> int:
    eng = spec.engine
    per_request = -(-eng.max_model_len // eng.block_size)
    return (eng.max_num_seqs or 1) * per_request


def plan(spec: ServiceSpec) -> Sizing:
    """The sizing the operator applies; InsufficientGPUMemoryError when nothing fits."""
    candidates = gpu_candidates(spec)
    if not candidates:
        raise InvalidSpecError(
            f"no power-of-two GPU count up to {spec.max_gpus_per_replica} divides the model's "
            f"{spec.model.arch.heads} attention heads; raise spec.gpu.maxPerReplica")
    for gpus in candidates:
        budget = budget_per_gpu(spec, gpus)
        if budget.num_blocks >= blocks_needed(spec):
            if gpus > GPUS_PER_NODE:
                raise InvalidSpecError(_multi_node(spec, gpus), reason="MultiNodeUnsupported")
            return _sizing(spec, gpus, budget)
    raise InsufficientGPUMemoryError(_refusal(spec, candidates[-1], budget))


def _multi_node(spec: ServiceSpec, gpus: int) -> str:
    return (f"{spec.model.key} needs {gpus} GPUs per replica, more than one node's "
            f"{GPUS_PER_NODE}: multi-node tensor parallelism (one replica over several machines) "
            "is not supported. Lower maxModelLen/maxNumSeqs, use kvCacheDtype fp8 or a bigger "
            f"GPU type, or set spec.gpu.maxPerReplica <= {GPUS_PER_NODE} "
            "(docs/guides/deploying.md: how it would map onto a LeaderWorkerSet)")


def _device_words(spec: ServiceSpec, gpus: int) -> str:
    mem = spec.gpu_memory_bytes / GiB
    if spec.device == "cpu":
        return f"CPU pod with {mem:.2f} GiB"
    return f"{gpus} x {spec.gpu_type or 'GPU'} ({mem:.2f} GiB each)"


def _sizing(spec: ServiceSpec, gpus: int, b: MemoryBudget) -> Sizing:
    eng, arch = spec.engine, spec.model.arch
    wdt, kdt = weight_dtype(spec), kv_dtype(spec)
    weights = arch.weight_bytes(dtype_bytes(wdt))
    usable = spec.gpu_memory_bytes * eng.gpu_memory_utilization
    swap = min(cpu_swap_bytes(spec), max(b.kv_bytes, 0))
    explanation = (
        f"{_device_words(spec, gpus)} x {eng.gpu_memory_utilization:.2f} utilisation; "
        f"{'per pod' if spec.device == 'cpu' else 'per GPU'}: "
        f"{usable / GiB:.2f} GiB - weights "
        f"{b.weight_bytes / GiB:.2f} GiB ({_weight_words(arch, wdt)} / {gpus}) - activations "
        f"{b.activation_peak_bytes / GiB:.2f} GiB"
        + (f" - swap {swap / GiB:.2f} GiB (swapSpaceGiB, at most the KV cache)"
           if spec.device == "cpu" else "")
        + f" = KV {b.kv_bytes / GiB:.2f} GiB; "
        f"{b.bytes_per_block / 1024:.0f} KiB per block of {eng.block_size} tokens ({kdt}) -> "
        f"{b.num_blocks} blocks = {b.num_blocks * eng.block_size} tokens -> max concurrency "
        f"{b.max_concurrency} requests of {eng.max_model_len} tokens")
    if b.max_concurrency_windowed != b.max_concurrency:
        explanation += (f" ({b.max_concurrency_windowed} with {_window_words(arch)} capped at "
                        "their window)")
    if gpus > 1 and spec.device != "cpu":
        explanation += (f"; tensor parallel over {gpus} GPUs of one node "
                        f"(--tensor-parallel-size {gpus}, NCCL, memory-backed /dev/shm), each "
                        f"holding 1/{gpus} of the weights and "
                        f"{kv_heads_per_rank(arch.kv_heads, gpus)} of {arch.kv_heads} KV heads")
    share = gpus if spec.device != "cpu" else 1
    kv = eng.kv_offloading
    offload.check(kv, b.bytes_per_block * share, gpus)
    explanation += offload.words(kv, b.bytes_per_block * share)
    return Sizing(
        gpus_per_replica=0 if spec.device == "cpu" else gpus, weight_bytes=weights,
        kv_bytes=b.kv_bytes * share, bytes_per_block=b.bytes_per_block * share,
        num_blocks=b.num_blocks, max_concurrency=b.max_concurrency,
        max_concurrency_windowed=b.max_concurrency_windowed,
        max_num_seqs=eng.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        activation_peak_bytes=b.activation_peak_bytes, device_memory_bytes=spec.gpu_memory_bytes,
        weight_dtype=wdt, kv_cache_dtype=kdt, explanation=explanation,
        kv_offloading=offload.status(kv, b.bytes_per_block * share), model_source=arch.origin)


def _weight_words(arch: ModelArch, wdt: str) -> str:
    if arch.weights is None:
        return f"{arch.parameters / 1e9:.2f}B params x {dtype_bytes(wdt)} B {wdt}"
    stored = ", ".join(sorted(arch.weights.bytes_by_dtype))
    return (f"{arch.parameters / 1e9:.2f}B params from the safetensors headers ({stored}; "
            f"floating tensors as {wdt})")


def _window_words(arch: ModelArch) -> str:
    return ", ".join(f"{g.num_layers} layers of window {g.window}" for g in arch.layer_groups
                     if g.window is not None)


def _refusal(spec: ServiceSpec, gpus: int, b: MemoryBudget) -> str:
    eng = spec.engine
    need = blocks_needed(spec)
    return (
        f"{spec.model.key} does not fit in {_device_words(spec, gpus)} at "
        f"gpu_memory_utilization {eng.gpu_memory_utilization:.2f}: per GPU "
        f"{spec.gpu_memory_bytes * eng.gpu_memory_utilization / GiB:.2f} GiB - weights "
        f"{b.weight_bytes / GiB:.2f} GiB - activations {b.activation_peak_bytes / GiB:.2f} GiB "
        + ("- swap (swapSpaceGiB, at most the KV cache) " if spec.device == "cpu" else "")
        + f"leaves {b.kv_bytes / GiB:.2f} GiB for KV = {b.num_blocks} blocks, but "
        f"{eng.max_num_seqs or 1} x {eng.max_model_len} tokens need {need} blocks "
        f"({need * b.bytes_per_block / GiB:.2f} GiB). Raise spec.gpu.maxPerReplica, pick a "
        f"bigger spec.gpu.type, lower maxModelLen/maxNumSeqs, or use kvCacheDtype fp8")

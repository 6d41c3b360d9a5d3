"""Sizing: the engine's memory budget (engine/sizing/memory.py) -> a replica's layout (tensor
parallel x pipeline parallel), blocks, concurrency, and the replicas for a concurrency target.

Every layout (engine/sizing/parallel_layout.py: TP a power of two within a node, PP stages across
nodes) is costed per rank exactly as the engine computes it with `--tensor-parallel-size T
--pipeline-parallel-size P`; the one that holds the target (spec.sizing.targetConcurrency,
else maxNumSeqs on one replica, else DEFAULT_TARGET_CONCURRENCY) full-length requests at the
fewest GPUs wins. A replica over several nodes becomes a LeaderWorkerSet
(leader_worker_set.py). Pure: no Kubernetes, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvserve.engine.defaults import MAX_NUM_SEQS
from kvserve.engine.sizing.memory import (
    default_max_num_batched_tokens,
    GiB, MemoryBudget, activation_peak_bytes, dtype_bytes, kv_heads_per_rank, plan_memory,
    rank_weight_bytes,
)
from kvserve.engine.sizing.host_memory import cpu_kv_bytes
from kvserve.engine.sizing.parallel_layout import (
    DEFAULT_TARGET_CONCURRENCY, Choice, Layout, Option, candidate_layouts, choose,
)
from kvserve.operator import offload
from kvserve.operator.catalog import ModelArch
from kvserve.operator.spec import InvalidSpecError, ServiceSpec

DEFAULT_MAX_NUM_SEQS = MAX_NUM_SEQS  # the engine's own default (EngineConfig.max_num_seqs)
SLOW_DECODE_MS = 50.0  # a decode step bound above this (under 20 tokens/s per stream) is warned


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
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nodes_per_replica: int = 1  # above 1: a LeaderWorkerSet group of this many pods
    gpus_per_pod: int = 0  # GPUs each pod of a replica asks for (0 on cpu)
    target_concurrency: int = DEFAULT_TARGET_CONCURRENCY
    replicas_for_target: int = 1  # replicas that hold target_concurrency
    alternatives: tuple[dict, ...] = ()  # layouts not chosen, and why
    warnings: tuple[str, ...] = ()  # per-token latency caveats of the chosen layout
    co_location: object = None  # spec.models placed in each replica (co_location.CoLocation)


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
            "tensorParallelSize": self.tensor_parallel_size,
            "pipelineParallelSize": self.pipeline_parallel_size,
            "nodesPerReplica": self.nodes_per_replica, "gpusPerNode": self.gpus_per_pod,
            "targetConcurrency": self.target_concurrency,
            "replicasForTarget": self.replicas_for_target,
            **({"kvOffloading": self.kv_offloading} if self.kv_offloading else {}),
            **({"coLocatedModels": self.co_location.as_status()}  # type: ignore[attr-defined]
               if self.co_location is not None else {}),
            "alternatives": list(self.alternatives), "warnings": list(self.warnings),
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
    """Tensor-parallel sizes: powers of two up to maxPerReplica (and one past a node, listed as
    refused) that the engine can split the model over (heads, KV heads, MLP:
    engine/distributed.py's rule)."""
    if spec.device == "cpu":
        return [1]
    arch, out, n = spec.model.arch, [], 1
    while n <= min(spec.max_gpus_per_replica, 2 * spec.gpus_per_node):
        if arch.heads % n == 0 and (arch.kv_heads % n == 0 or n % arch.kv_heads == 0) and \
                arch.intermediate % n == 0:
            out.append(n)
        n *= 2
    return out


def activation_bytes(spec: ServiceSpec, gpus: int = 1) -> int:
    """One rank's activation peak with the model split over `gpus` (tensor parallel); a
    pipeline stage's is no larger (the last stage holds the logits)."""
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


def stage_layers(layers: int, pp: int) -> int:
    """Layers of the largest pipeline stage (stages split by layer, the first ones longer)."""
    return -(-layers // pp)


def stage_weight_bytes(arch: ModelArch, weights: int, tp: int, pp: int) -> int:
    """One rank's weights: 1/tp of its stage's. With pp > 1, the largest stage's layers plus
    the embedding (first stage) or lm_head (last stage), whichever end it is; a tied lm_head is
    one matrix in the checkpoint but a copy on the last stage."""
    if pp == 1:
        return rank_weight_bytes(weights, tp)
    ends = weights * arch.vocab * arch.hidden // max(arch.parameters, 1)
    body = max(weights - (1 if arch.tied_embeddings else 2) * ends, 0)
    stage = body * stage_layers(arch.layers, pp) // arch.layers + ends
    return rank_weight_bytes(stage, tp)


def budget_per_gpu(spec: ServiceSpec, gpus: int, pp: int = 1) -> MemoryBudget:
    """The engine's budget on each of `gpus` tensor-parallel GPUs of a pipeline stage (pp
    stages): 1/gpus of the stage's weights and KV heads, the stage's layers' KV.
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
    layers = stage_layers(arch.layers, pp)
    groups = arch.layer_groups if pp == 1 else ()  # a stage's window groups are not tracked
    return plan_memory(
        total_bytes=total, gpu_memory_utilization=util,
        weight_bytes=stage_weight_bytes(arch, weights, gpus, pp),
        activation_peak=activation_bytes(spec, gpus),
        num_layers=layers, num_kv_heads=kv_heads_per_rank(arch.kv_heads, gpus),
        head_dim=arch.head_dim, kv_dtype_bytes=dtype_bytes(kv_dtype(spec)),
        block_size=eng.block_size, tokens_per_request=eng.max_model_len,
        layer_groups=groups or None)


def blocks_needed(spec: ServiceSpec) -> int:
    eng = spec.engine
    per_request = -(-eng.max_model_len // eng.block_size)
    return per_replica_minimum(spec) * per_request


def per_replica_minimum(spec: ServiceSpec) -> int:
    """Full-length requests one replica must hold: maxNumSeqs when it is set without a
    concurrency target (a replica honours its own cap, one replica), else one."""
    eng = spec.engine
    return eng.max_num_seqs if eng.max_num_seqs and spec.target_concurrency is None else 1


def concurrency_target(spec: ServiceSpec) -> int:
    """spec.sizing.targetConcurrency; else maxNumSeqs (on one replica); else the default."""
    if spec.target_concurrency is not None:
        return spec.target_concurrency
    return spec.engine.max_num_seqs or DEFAULT_TARGET_CONCURRENCY


def choose_layout(spec: ServiceSpec) -> tuple[Choice, Layout]:
    """(the choice, the largest layout tried, whose budget a refusal quotes)."""
    tps = gpu_candidates(spec)
    if not tps:
        raise InvalidSpecError(
            f"no power-of-two GPU count up to {spec.max_gpus_per_replica} divides the model's "
            f"{spec.model.arch.heads} attention heads; raise spec.gpu.maxPerReplica")
    per_node = spec.gpus_per_node if spec.device != "cpu" else 1
    layouts, refused = candidate_layouts(
        tps, spec.model.arch.layers if spec.device != "cpu" else 1, per_node,
        spec.max_gpus_per_replica)
    if not layouts:
        raise InvalidSpecError(
            f"no layout within spec.gpu.maxPerReplica {spec.max_gpus_per_replica} keeps tensor "
            f"parallel within a node of {per_node} GPUs", reason="InsufficientGPUMemory")
    need = per_replica_minimum(spec)
    per_request = -(-spec.engine.max_model_len // spec.engine.block_size)

    def held(layout: Layout) -> int:
        requests = budget_per_gpu(spec, layout.tp, layout.pp).num_blocks // per_request
        return requests if requests >= need else 0

    cap = spec.engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    choice = choose(layouts, held, concurrency_target(spec), cap, refused)
    largest = max(layouts, key=lambda lay: (lay.gpus, lay.tp))
    return choice, largest


def plan(spec: ServiceSpec) -> Sizing:
    """The sizing the operator applies; InsufficientGPUMemoryError when nothing fits."""
    choice, largest = choose_layout(spec)
    if choice.chosen is None:
        budget = budget_per_gpu(spec, largest.tp, largest.pp)
        raise InsufficientGPUMemoryError(_refusal(spec, largest, budget))
    lay = choice.chosen.layout
    sizing = _sizing(spec, choice, budget_per_gpu(spec, lay.tp, lay.pp))
    if spec.models:  # several models in each replica, when they fit (co_location.py)
        from kvserve.operator import co_location

        co = co_location.plan(spec, sizing)
        sizing = replace(sizing, co_location=co,
                         explanation=sizing.explanation + "; " + co.explanation)
    return sizing


def _device_words(spec: ServiceSpec, gpus: int) -> str:
    mem = spec.gpu_memory_bytes / GiB
    if spec.device == "cpu":
        return f"CPU pod with {mem:.2f} GiB"
    return f"{gpus} x {spec.gpu_type or 'GPU'} ({mem:.2f} GiB each)"


def _sizing(spec: ServiceSpec, choice: Choice, b: MemoryBudget) -> Sizing:
    eng, arch = spec.engine, spec.model.arch
    chosen = choice.chosen
    assert chosen is not None
    lay = chosen.layout
    gpus = lay.gpus
    wdt, kdt = weight_dtype(spec), kv_dtype(spec)
    weights = arch.weight_bytes(dtype_bytes(wdt))
    usable = spec.gpu_memory_bytes * eng.gpu_memory_utilization
    swap = min(cpu_swap_bytes(spec), max(b.kv_bytes, 0))
    share_words = f"{_weight_words(arch, wdt)} / {gpus}" if lay.pp == 1 else \
        f"the largest of {lay.pp} stages: {stage_layers(arch.layers, lay.pp)} layers / {lay.tp}"
    explanation = (
        f"{_device_words(spec, gpus)} x {eng.gpu_memory_utilization:.2f} utilisation; "
        f"{'per pod' if spec.device == 'cpu' else 'per GPU'}: "
        f"{usable / GiB:.2f} GiB - weights "
        f"{b.weight_bytes / GiB:.2f} GiB ({share_words}) - activations "
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
    if lay.tp > 1 and spec.device != "cpu":
        explanation += (f"; tensor parallel over {lay.tp} GPUs of one node "
                        f"(--tensor-parallel-size {lay.tp}, NCCL, memory-backed /dev/shm), each "
                        f"holding 1/{lay.tp} of the weights and "
                        f"{kv_heads_per_rank(arch.kv_heads, lay.tp)} of {arch.kv_heads} KV heads")
    if lay.pp > 1:
        explanation += (f"; pipeline parallel over {lay.pp} stages (--pipeline-parallel-size "
                        f"{lay.pp}) on {lay.nodes} node(s) of {lay.gpus_per_pod} GPUs")
    explanation += _target_words(spec, chosen)
    share = gpus if spec.device != "cpu" else 1
    kv = eng.kv_offloading
    offload.check(kv, b.bytes_per_block * share, gpus)
    explanation += offload.words(kv, b.bytes_per_block * share)
    cpu = spec.device == "cpu"
    return Sizing(
        gpus_per_replica=0 if cpu else gpus, weight_bytes=weights,
        kv_bytes=b.kv_bytes * share, bytes_per_block=b.bytes_per_block * share,
        num_blocks=b.num_blocks, max_concurrency=b.max_concurrency,
        max_concurrency_windowed=b.max_concurrency_windowed,
        max_num_seqs=eng.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        activation_peak_bytes=b.activation_peak_bytes, device_memory_bytes=spec.gpu_memory_bytes,
        weight_dtype=wdt, kv_cache_dtype=kdt, explanation=explanation,
        kv_offloading=offload.status(kv, b.bytes_per_block * share), model_source=arch.origin,
        tensor_parallel_size=lay.tp, pipeline_parallel_size=lay.pp,
        nodes_per_replica=1 if cpu else lay.nodes, gpus_per_pod=0 if cpu else lay.gpus_per_pod,
        target_concurrency=concurrency_target(spec), replicas_for_target=chosen.replicas,
        alternatives=() if cpu else tuple(o.as_status() for o in choice.rejected),
        warnings=tuple(latency_warnings(spec, lay)))


def _target_words(spec: ServiceSpec, chosen: Option) -> str:
    if spec.device == "cpu":
        return ""
    if per_replica_minimum(spec) > 1:
        return (f"; sized for maxNumSeqs {spec.engine.max_num_seqs} full-length requests on "
                "one replica (set spec.sizing.targetConcurrency to size across replicas)")
    source = "spec.sizing.targetConcurrency" if spec.target_concurrency is not None else \
        "the default target"
    return (f"; {source} {concurrency_target(spec)}: {chosen.replicas} replica(s) x "
            f"{chosen.concurrency} requests = {chosen.total_gpus} GPUs in all, the fewest of "
            "the layouts tried")


def decode_ms_per_token(spec: ServiceSpec, layout: Layout) -> float:
    """A lower bound on one decode step: every stage reads its weights once (an MoE's active
    experts), one stage after another, each at its TP group's memory bandwidth: weights / (TP x
    bandwidth). Pipeline
    stages add capacity, not speed. 0 when the GPU's bandwidth is unknown."""
    if not spec.memory_bandwidth:
        return 0.0
    arch = spec.model.arch
    weights = arch.weight_bytes(dtype_bytes(weight_dtype(spec))) * arch.active_share()
    return 1e3 * weights / (layout.tp * spec.memory_bandwidth)


def latency_warnings(spec: ServiceSpec, layout: Layout) -> list[str]:
    """Where the chosen layout's per-token latency is bandwidth-poor."""
    if spec.device == "cpu":
        return []
    out, ms = [], decode_ms_per_token(spec, layout)
    if layout.nodes > 1:
        hop = spec.model.arch.hidden * dtype_bytes(weight_dtype(spec))
        out.append(f"pipeline across {layout.nodes} nodes: every decode step sends each "
                   f"sequence's hidden state ({hop / 1024:.0f} KiB per token) over "
                   f"{layout.nodes - 1} node link(s) and runs the {layout.pp} stages one after "
                   f"another, so per-token latency is no better than TP {layout.tp} alone"
                   + (f" (>= {ms:.1f} ms per token from memory bandwidth)" if ms else "")
                   + "; give the nodes a fast interconnect (InfiniBand/RoCE for NCCL)")
    if ms > SLOW_DECODE_MS:
        out.append(f"bandwidth-poor: >= {ms:.1f} ms per token per sequence (weights / TP "
                   f"{layout.tp} / {spec.memory_bandwidth / 1e12:.2f} TB/s), under "
                   f"{1e3 / ms:.0f} tokens/s per stream; a larger TP within a node or fp8 "
                   "weights lower it")
    return out


def _weight_words(arch: ModelArch, wdt: str) -> str:
    if arch.weights is None:
        return f"{arch.parameters / 1e9:.2f}B params x {dtype_bytes(wdt)} B {wdt}"
    stored = ", ".join(sorted(arch.weights.bytes_by_dtype))
    return (f"{arch.parameters / 1e9:.2f}B params from the safetensors headers ({stored}; "
            f"floating tensors as {wdt})")


def _window_words(arch: ModelArch) -> str:
    return ", ".join(f"{g.num_layers} layers of window {g.window}" for g in arch.layer_groups
                     if g.window is not None)


def _refusal(spec: ServiceSpec, layout: Layout, b: MemoryBudget) -> str:
    eng = spec.engine
    need = blocks_needed(spec)
    gpus = layout.gpus
    staged = f" ({layout.pp} pipeline stages of {layout.tp})" if layout.pp > 1 else ""
    return (
        f"{spec.model.key} does not fit in {_device_words(spec, gpus)}{staged} at "
        f"gpu_memory_utilization {eng.gpu_memory_utilization:.2f}: per GPU "
        f"{spec.gpu_memory_bytes * eng.gpu_memory_utilization / GiB:.2f} GiB - weights "
        f"{b.weight_bytes / GiB:.2f} GiB - activations {b.activation_peak_bytes / GiB:.2f} GiB "
        + ("- swap (swapSpaceGiB, at most the KV cache) " if spec.device == "cpu" else "")
        + f"leaves {b.kv_bytes / GiB:.2f} GiB for KV = {b.num_blocks} blocks, but "
        f"{eng.max_num_seqs or 1} x {eng.max_model_len} tokens need {need} blocks "
        f"({need * b.bytes_per_block / GiB:.2f} GiB). Raise spec.gpu.maxPerReplica, pick a "
        f"bigger spec.gpu.type, lower maxModelLen/maxNumSeqs, or use kvCacheDtype fp8")

"""spec.models: several small models in one replica over one shared KV pool (the engine's
`--additional-model NAME=PATH`, engine/multi_model.py), placed there only when sizing says they
fit: one GPU (or CPU pod) holding every model's weights, the activations, and a shared pool of
the primary model's pages that still holds one full-length request per model.

Pure functions of the spec and the primary model's sizing; the router needs nothing from here:
a replica's heartbeat lists the additional models it serves (service/server/multi_model.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.sizing.memory import GiB, bytes_per_block, dtype_bytes
from kvserve.operator.spec import InvalidSpecError, ModelRef, ServiceSpec

HUB_SCHEMES = ("name", "hf")  # sources a replica loads by itself (no volume of their own)


@dataclass(frozen=True)
class CoLocation:
    """How the additional models share the primary's replica."""

    models: tuple[tuple[str, str], ...]  # (served name, what the engine loads)
    extra_weight_bytes: int
    pool_blocks: int  # pages of the primary's block left for every model together
    gpu_memory_utilization: float  # the engine's flag: the others' weights taken out of it
    kv_bytes: int  # the shared pool's bytes
    explanation: str

    def as_status(self) -> dict:
        return {"models": [n for n, _ in self.models], "extraWeightBytes": self.extra_weight_bytes,
                "sharedPoolBlocks": self.pool_blocks, "explanation": self.explanation}


def _source(ref: ModelRef) -> str:
    if ref.location.scheme not in HUB_SCHEMES:
        raise InvalidSpecError(
            f"spec.models: {ref.served_name!r} comes from {ref.location.scheme}://; a model "
            "sharing a replica is loaded by the engine from the hub (a catalog name, a hub id "
            "or hf://) — serve a claim's model as spec.model of its own KVInferenceService")
    return ref.source


def plan(spec: ServiceSpec, sizing: object) -> CoLocation:
    """The placement of spec.models on the primary's replica; InvalidSpecError when they do
    not fit (with the figures), so the service gets a condition and no workload."""
    s = sizing
    names = [spec.model.served_name] + [m.served_name for m in spec.models]
    if len(set(names)) != len(names):
        raise InvalidSpecError(f"spec.models: served names must differ, got {names}")
    if getattr(s, "tensor_parallel_size", 1) > 1 or getattr(s, "pipeline_parallel_size", 1) > 1:
        raise InvalidSpecError(
            "spec.models shares one GPU's memory among small models; the primary model alone "
            f"needs {s.gpus_per_replica} GPUs (tensor/pipeline parallel): give each model its "
            "own KVInferenceService")
    eng, wdt = spec.engine, dtype_bytes(s.weight_dtype)
    kdt = dtype_bytes(s.kv_cache_dtype)
    page = s.bytes_per_block
    for m in spec.models:
        a = m.arch
        own = bytes_per_block(a.layers, a.kv_heads, a.head_dim, kdt, eng.block_size)
        if own > page:
            raise InvalidSpecError(
                f"spec.models: {m.served_name!r} needs {own} bytes per KV block, more than the "
                f"primary's {page}: a page holds one block of spec.model's layout, so put the "
                "model with the largest KV block in spec.model")
    extra = sum(m.arch.weight_bytes(wdt) for m in spec.models)
    kv = s.kv_bytes - extra
    per_request = -(-eng.max_model_len // eng.block_size)
    need = per_request * len(names)
    blocks = max(kv, 0) // page
    if blocks < need:
        raise InvalidSpecError(
            f"spec.models do not fit one replica: the primary's KV budget {s.kv_bytes / GiB:.2f} "
            f"GiB less the other models' weights {extra / GiB:.2f} GiB leaves {blocks} blocks, "
            f"and {len(names)} models need {need} ({per_request} each for one "
            f"{eng.max_model_len}-token request); use a larger GPU, a smaller maxModelLen, or "
            "a KVInferenceService per model", reason="InsufficientGPUMemory")
    util = eng.gpu_memory_utilization - extra / max(s.device_memory_bytes, 1)
    words = (f"{len(spec.models)} more model(s) in each replica ({', '.join(names[1:])}): "
             f"their weights {extra / GiB:.2f} GiB come out of the KV budget; one shared pool "
             f"of {blocks} blocks ({kv / GiB:.2f} GiB) serves all {len(names)} models, free pages "
             "going to whichever needs them")
    return CoLocation(tuple((m.served_name, _source(m)) for m in spec.models), extra, blocks,
                      round(util, 4), kv, words)


def engine_args(co: CoLocation | None) -> list[str]:
    """The `--additional-model NAME=PATH` flags of a replica."""
    if co is None:
        return []
    return [arg for name, src in co.models for arg in ("--additional-model", f"{name}={src}")]

"""The connector named by `kv_transfer_config`: a registered name or, with
`kv_connector_module_path`, a `KVConnectorBase_V1` subclass in that module (vLLM's rule).
`make_connectors` builds an engine's two instances (scheduler side, worker side)."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from kvserve.engine.kv_transfer.config import KVTransferConfig
from kvserve.engine.kv_transfer.wire import KVLayout

logger = logging.getLogger("kvserve.engine")

# name -> "module:Class"; NixlConnector is an alias: the same request protocol over kvserve's
# own TCP transfer, so llm-d manifests naming it run kvserve pods unchanged (docs/guides/
# disaggregation.md). A kvserve pod and a vLLM pod cannot be paired: the handshake refuses.
_REGISTRY = {
    "KVServeConnector": "kvserve.engine.kv_transfer.kvserve_connector:KVServeConnector",
    "NixlConnector": "kvserve.engine.kv_transfer.kvserve_connector:KVServeConnector",
}


@dataclass(frozen=True)
class EngineInfo:
    """What a connector may need to know of its engine."""

    layout: KVLayout
    block_size: int
    tp_size: int
    device: Any


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase_V1]:
    if config.kv_connector_module_path:
        module_name, name = config.kv_connector_module_path, config.kv_connector
    elif config.kv_connector in _REGISTRY:
        module_name, name = _REGISTRY[config.kv_connector].split(":")
    else:
        raise ConfigError(f"unknown kv_connector {config.kv_connector!r}: use one of "
                          f"{sorted(_REGISTRY)} or name a class with kv_connector_module_path")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"kv_connector {name!r} not found in {module_name!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ConfigError(f"kv_connector {name!r} must subclass "
                          "kvserve.engine.kv_transfer.base.KVConnectorBase_V1")
    return cls


def make_connectors(config: KVTransferConfig, engine: EngineInfo
                    ) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """(scheduler side, worker side). A connector whose constructor takes `shared` gets the
    scheduler side's shared state (KVServeConnector: its send registry and listener)."""
    cls = connector_class(config)
    if config.kv_connector == "NixlConnector" and not config.kv_connector_module_path:
        logger.info("kv_connector NixlConnector: kvserve moves blocks with its own TCP "
                    "transfer (KVServeConnector), vLLM's kv_transfer_params protocol")
    sched = cls(config, KVConnectorRole.SCHEDULER, engine)
    shared = getattr(sched, "shared", None)
    worker = cls(config, KVConnectorRole.WORKER, engine, shared=shared) if shared is not None \
        else cls(config, KVConnectorRole.WORKER, engine)
    return sched, worker


def engine_connectors(config: Any, runner: Any, kv_groups: Any, hf_config: Any
                      ) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1] | None:
    """An engine's connectors from its EngineConfig (None without kv_transfer_config), the
    worker side registered on the runner's KV cache (`[2, layers, blocks, block_size, heads,
    dim]`)."""
    kvt = config.kv_transfer_config
    if kvt is None:
        return None
    if getattr(config, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("kv_transfer_config: the KV connectors move the cache of tensor-"
                          "parallel ranks of one stage; pipeline_parallel_size must be 1")
    if kv_groups is not None and (kv_groups.is_hybrid or kv_groups.slides):
        raise ConfigError("kv_transfer_config: models with sliding-window layers keep several "
                          "block tables; the KV connectors move models of full attention only")
    kv = runner.kv
    archs = getattr(hf_config, "architectures", None) or ["?"]
    layout = KVLayout(model=str(config.model).rstrip("/").split("/")[-1],
                      architecture=str(archs[0]), num_layers=int(kv.shape[1]),
                      num_kv_heads=int(kv.shape[4]), head_dim=int(kv.shape[5]),
                      block_size=int(kv.shape[3]), kv_dtype=str(kv.dtype),
                      tp_size=int(config.tensor_parallel_size))
    engine = EngineInfo(layout, layout.block_size, layout.tp_size, kv.device)
    sched, worker = make_connectors(kvt, engine)
    worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(kv.shape[1])})
    workers = getattr(runner, "workers", None)
    if workers is not None:  # ranks 1..N-1: each its worker side on its own shard
        workers.broadcast("kv_connector", (kvt, layout))
        ports = workers.wait_for("kv_connector")
        server = getattr(getattr(worker, "shared", None), "server", None)
        if server is not None:
            server.rank_ports = [server.port, *ports]
    return sched, worker


def attach_worker_connector(runner: Any, rank: int, kvt: KVTransferConfig, layout: KVLayout
                            ) -> int | None:
    """A tensor-parallel worker's side of the connector on its runner's cache; its block
    server's port (None: it serves none)."""
    cls = connector_class(kvt)
    engine = EngineInfo(layout, layout.block_size, layout.tp_size, runner.kv.device)
    worker = cls(kvt, KVConnectorRole.WORKER, engine, rank=rank)
    worker.register_kv_caches({f"layers.{i}": runner.kv[:, i]
                               for i in range(runner.kv.shape[1])})
    runner.attach_kv_connector(worker)
    return getattr(worker, "server_port", None)

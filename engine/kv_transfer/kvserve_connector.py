"""KVServeConnector: the built-in connector that moves a prompt's KV blocks from a prefill
replica to a decode replica over TCP, or through shared memory when both run on one host
(kv_connector_extra_config `transport`: auto | tcp | shm; engine/kv_transfer/shm.py), with vLLM's
request protocol (`kv_transfer_params`).

Prefill side (kv_producer): a request sent with `{"do_remote_decode": true}` runs as usual
(max_tokens=1 by its sender); when it finishes its blocks are not freed but held in the
`SendRegistry`, and its output's kv_transfer_params say where they are (`remote_block_ids`,
`remote_engine_id`, `remote_host`, `remote_port`, `tp_size`, plus `remote_request_id`, the
prefill's own id the decode side names in its pull). Every rank's `BlockServer` streams them on
request; they are freed when the decode side confirms, or after `abort_request_timeout`.

Decode side (kv_consumer): a request sent with those params back (`do_remote_prefill`) waits in
the queue while a scheduler-side thread pulls the full prompt blocks the local prefix cache lacks
(so the engine keeps stepping meanwhile); then the scheduler admits it with those tokens counted
as external prefix-cache hits: it allocates blocks for them (registered in the prefix cache under
their hashes), the step's metadata carries the bytes, and the worker side scatters them into the
cache before the forward, which computes only the rest of the prompt (at least its last token).
A transfer that fails (peer gone, refused at the handshake, cut mid-stream, timed out) leaves the
request to compute its prompt locally: nothing is lost, the reason is logged and counted.

Overlap: the pull runs while the engine keeps stepping the other requests, and a request is
admitted once its bytes are on this host, so a transfer that fails never leaves a half-filled
block in the cache (vLLM's recompute of blocks whose load failed mid-forward is not needed).
Writing them into the cache is layer by layer inside the admitting step's forward:
`start_load_kv` starts a thread (a side stream on CUDA) that scatters layer after layer, and the
model waits in `wait_for_layer_load` only for layer i before layer i's attention (the runner
installs that hook where the model has one; `wait_for_save` waits for the rest). The wire is
layer by layer too (the prefill side gathers layer i + 1 while layer i is on its way).
`save_kv_layer` has nothing to do: the prefill side serves its live cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                             KVConnectorRole, kv_transfer_params)
from kvserve.engine.kv_transfer.consumer import Remote, confirm_only, fetch_shards
from kvserve.engine.kv_transfer.layer_loader import LayerLoader
from kvserve.engine.kv_transfer.producer import BlockServer, SendRegistry
from kvserve.engine.kv_transfer.shm import TRANSPORTS, MappingCache, allowed
from kvserve.engine.kv_transfer.wire import TransferError

logger = logging.getLogger("kvserve.engine")

DEFAULT_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
DEFAULT_ABORT_TIMEOUT_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
EXTRA_KEYS = ("kv_port", "kv_host", "kv_bind_host", "abort_request_timeout",
              "transfer_timeout", "num_fetch_threads", "transport")


@dataclass
class TransferFigures:
    """Cumulative counts of one engine's transfers (both sides)."""

    blocks_received: int = 0
    bytes_received: int = 0
    transfers: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    seconds: list[float] = field(default_factory=list)  # each finished pull's wall time
    bytes_by_transport: dict[str, int] = field(default_factory=dict)  # tcp / shm -> received
    layerwise_loads: int = 0  # steps whose loads landed layer by layer inside the forward


@dataclass
class _Recv:
    """One decode request's pull: blocks [start, end) of its prompt."""

    remote: Remote
    start: int
    end: int
    remote_id: str = ""  # the prefill's request id (what its registry holds)
    future: Future | None = None
    payload: list[torch.Tensor] | None = None  # per rank: [layers, 2, n, per-block bytes] uint8
    used: bool = False


class KVServeMetadata(KVConnectorMetadata):
    """A step's loads: (each rank's payload, destination block ids) pairs."""

    def __init__(self) -> None:
        self.loads: list[tuple[list[torch.Tensor], list[int]]] = []

    def __bool__(self) -> bool:
        return bool(self.loads)


def side_channel(config: Any) -> tuple[str, str, int]:
    """(advertised host, bind host, port) from the extra config, vLLM's kv_ip / kv_port, or
    vLLM's NIXL side-channel variables."""
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown} for "
                          f"KVServeConnector; known: {list(EXTRA_KEYS)}")
    port = extra.get("kv_port", config.kv_port)
    if port is None:
        port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_PORT))
    host = extra.get("kv_host") or config.kv_ip or os.environ.get(
        "VLLM_NIXL_SIDE_CHANNEL_HOST") or os.environ.get("POD_IP") or "127.0.0.1"
    return str(host), str(extra.get("kv_bind_host", "0.0.0.0")), int(port)


class KVServeConnector(KVConnectorBase_V1):
    """Both sides in one class (vLLM's NixlConnector splits them into a scheduler and a worker
    object); the engine makes one instance per role, sharing `shared` (the send registry and
    the listener's address). With tensor parallelism every rank has a worker side (`rank`):
    each serves and loads its own shard of the cache; rank 0's server checks the requests and
    names the others' ports at the handshake."""

    def __init__(self, config: Any, role: KVConnectorRole, engine: Any = None,
                 shared: Any = None, rank: int = 0) -> None:
        super().__init__(config, role, engine)
        self.rank = rank
        self.shared = shared if shared is not None else _Shared(config)
        self.figures = self.shared.figures
        self._recv: dict[str, _Recv] = {}
        self._meta = KVServeMetadata()
        self._pool: ThreadPoolExecutor | None = None
        self._layers: list[torch.Tensor] = []  # worker: each layer's cache as bytes
        self._loader: LayerLoader | None = None  # worker: the step's loads, layer by layer
        # worker: set by the model runner when the model calls wait_for_layer_load per layer
        self.layerwise = False

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        self._layers = [t.view(torch.uint8) for t in layers]
        if self.config.is_kv_producer and self.engine is not None:
            self.shared.start_server(self.engine, layers, self.rank)

    @property
    def server_port(self) -> int | None:
        """This rank's block server's port (None: not a producer)."""
        return self.shared.server_port

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        self.wait_for_save()  # a previous step's loads (one with no forward) land first
        meta = self.get_connector_metadata()
        if not isinstance(meta, KVServeMetadata) or not meta.loads:
            return
        loader = LayerLoader(meta.loads, self._layers, self.rank)
        if self.layerwise:
            self._loader = loader
            self.figures.layerwise_loads += 1
        else:  # a model without the per-layer hook: everything lands before the forward
            loader.finish()

    def wait_for_layer_load(self, layer_name: str) -> None:
        loader = self._loader
        if loader is not None:
            loader.wait(int(layer_name.rsplit(".", 1)[-1]))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # the prefill side serves its live cache; nothing is copied out

    def wait_for_save(self) -> None:
        """After the forward: the step's loads are all in place (nothing is saved)."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.finish()

    def get_finished(self, finished_req_ids: set[str] | None = None
                     ) -> tuple[set[str] | None, set[str] | None]:
        return (self.shared.registry.take_released() or None), None

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = kv_transfer_params(request)
        if not self.config.is_kv_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        st = self._recv.get(request.request_id)
        if st is None:
            st = self._start(request, params, num_computed_tokens)
            if st is None:
                return 0, False
        if st.future is not None:
            if not st.future.done():
                return None, False
            self._collect(request.request_id, st)
        local = num_computed_tokens // self.engine.block_size
        if st.payload is None or st.used or not st.start <= local < st.end:
            return 0, False
        return (st.end - local) * self.engine.block_size, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        st = self._recv.get(request.request_id)
        if st is None or st.payload is None or not num_external_tokens:
            return
        n = num_external_tokens // self.engine.block_size
        skip = st.end - n - st.start  # blocks the local prefix cache has gained meanwhile
        self._meta.loads.append(([p[:, :, skip:skip + n].contiguous() for p in st.payload],
                                 list(block_ids)))
        self.figures.blocks_received += n
        st.payload, st.used = None, True

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVServeMetadata()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._recv.pop(request.request_id, None)
        params = kv_transfer_params(request)
        if not self.config.is_kv_producer or not params or not params.get("do_remote_decode"):
            return False, None
        if request.finish_reason not in ("stop", "length") or request.params.n != 1 \
                or not block_ids or self.shared.server_port is None:
            return False, None
        self.shared.registry.hold(request.request_id, block_ids)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": list(block_ids),
                      "remote_engine_id": self.config.engine_id,
                      "remote_host": self.shared.host, "remote_port": self.shared.server_port,
                      "remote_request_id": request.request_id, "tp_size": self.engine.tp_size}

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.shared.close()

    # ---- the decode side's pulls --------------------------------------------------------------
    def _start(self, request: Any, params: dict[str, Any], num_computed: int) -> _Recv | None:
        """Begin pulling the prompt's full blocks past the local prefix (None: nothing to
        pull, or params that name no usable source: the request computes its prompt)."""
        try:
            remote = Remote(str(params["remote_engine_id"]), str(params["remote_host"]),
                            int(params["remote_port"]),
                            tuple(int(b) for b in params["remote_block_ids"]),
                            int(params.get("tp_size", 1)))
            remote_id = str(params.get("remote_request_id") or request.request_id)
        except (KeyError, TypeError, ValueError) as exc:
            self._failed("params", f"request {request.request_id}: kv_transfer_params without "
                         f"a usable remote ({exc!r}); computing the prompt here")
            return None
        bs = self.engine.block_size
        end = min(len(remote.block_ids), (request.num_tokens - 1) // bs)
        st = _Recv(remote, num_computed // bs, end, remote_id)
        self._recv[request.request_id] = st
        if remote.tp_size != self.engine.tp_size:
            self._failed("handshake", f"KV transfer refused: the prefill engine runs "
                         f"tensor_parallel_size {remote.tp_size}, this one {self.engine.tp_size}"
                         "; run both with the same --tensor-parallel-size")
            self._confirm(remote, remote_id)
            return st
        if st.start >= st.end:  # nothing worth pulling: let the prefill side free its blocks
            self._confirm(remote, remote_id)
            return st
        ids = list(remote.block_ids[st.start:st.end])
        st.future = self._executor().submit(self._pull, remote, remote_id, ids)
        return st

    def _pull(self, remote: Remote, remote_id: str, ids: list[int]
              ) -> tuple[list[torch.Tensor], dict[str, int]]:
        t0 = time.perf_counter()
        by_transport: dict[str, int] = {}
        out = fetch_shards(remote, remote_id, ids, self.engine.layout, self.config.engine_id,
                           self.shared.transfer_timeout, self.shared.transports, by_transport,
                           self.shared.mappings)
        with self.shared.lock:
            self.figures.seconds.append(time.perf_counter() - t0)
            del self.figures.seconds[:-4096]
        return out, by_transport

    def _collect(self, request_id: str, st: _Recv) -> None:
        future, st.future = st.future, None
        try:
            st.payload, by_transport = future.result()  # type: ignore[union-attr]
            for name, n in by_transport.items():
                self.figures.bytes_by_transport[name] = \
                    self.figures.bytes_by_transport.get(name, 0) + n
            self.figures.transfers += 1
            self.figures.bytes_received += sum(p.numel() for p in st.payload)
        except TransferError as exc:
            self._failed(exc.reason, f"request {request_id}: {exc}; computing the prompt here")
            if exc.reason in ("handshake", "refused", "transport"):
                self._confirm(st.remote, st.remote_id or request_id)
        except Exception as exc:  # noqa: BLE001 - any failure falls back to local prefill
            self._failed("transfer", f"request {request_id}: KV transfer failed: {exc!r}; "
                         "computing the prompt here")

    def _failed(self, reason: str, message: str) -> None:
        self.figures.failures[reason] = self.figures.failures.get(reason, 0) + 1
        logger.warning("%s", message)

    def _confirm(self, remote: Remote, remote_id: str) -> None:
        self._executor().submit(confirm_only, remote, remote_id, self.shared.transfer_timeout)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(int(self.config.extra("num_fetch_threads", 4)),
                                            thread_name_prefix="kv-pull")
        return self._pool


class _Shared:
    """What the two roles of one engine share: the registry of held sends, the listener."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.host, self.bind_host, self.port = side_channel(config)
        self.registry = SendRegistry(float(config.extra(
            "abort_request_timeout", os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
                                                    DEFAULT_ABORT_TIMEOUT_S))))
        self.transfer_timeout = float(config.extra("transfer_timeout",
                                                   DEFAULT_TRANSFER_TIMEOUT_S))
        self.figures = TransferFigures()
        self.lock = threading.Lock()  # the pull threads' share of the figures
        self.transport = str(config.extra("transport", "auto"))
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"kv_connector_extra_config.transport must be one of "
                              f"{list(TRANSPORTS)}, got {self.transport!r}")
        self.transports = allowed(self.transport)
        self.mappings = MappingCache()  # the decode side's of producers' segments
        if not self.transports:
            raise ConfigError("kv_connector_extra_config.transport is shm but this platform has "
                              "no memfd_create or /proc; use auto or tcp")
        self.server: BlockServer | None = None

    @property
    def server_port(self) -> int | None:
        return None if self.server is None else self.server.port

    def start_server(self, engine: Any, layers: list[torch.Tensor], rank: int = 0) -> None:
        """This rank's block server: port + rank (any free port when port is 0); only rank 0's
        checks requests against the registry (the others serve what rank 0 let through)."""
        try:
            self.server = BlockServer(engine.layout, self.config.engine_id, layers,
                                      self.registry if rank == 0 else None, self.bind_host,
                                      self.port + rank if self.port else 0, self.transports)
        except OSError as exc:
            raise ConfigError(f"KVServeConnector cannot listen on {self.bind_host}:{self.port} "
                              f"({exc}); set kv_connector_extra_config.kv_port to a free port "
                              "(0: any)") from None
        logger.info("KV transfer: rank %d serving blocks on %s:%d as %s (engine %s)", rank,
                    self.bind_host, self.server.port, self.host, self.config.engine_id)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.mappings.clear()


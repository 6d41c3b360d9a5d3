"""`KVConnectorBase_V1`: the contract between the engine and a KV connector, in vLLM v1's shape.

A connector runs as two instances. The scheduler side (`KVConnectorRole.SCHEDULER`, beside the
`Scheduler`) decides what to load: `get_num_new_matched_tokens` says how many prompt tokens past
the local prefix cache the connector can supply (None: not known yet, ask again next step),
`update_state_after_alloc` learns the blocks allocated for them, `build_connector_meta` packs the
step's work for the worker side, and `request_finished` says whether a finished request's blocks
must outlive it (a prefill replica keeps them until the decode side has them) and what its
output's `kv_transfer_params` are. The worker side (`KVConnectorRole.WORKER`, beside the model
runner's KV tensors) does the moves: `register_kv_caches`, `start_load_kv` /
`wait_for_layer_load` around the forward, `save_kv_layer` / `wait_for_save` after it, and
`get_finished` reports the requests whose sends or receives completed.

The engine's calls (engine/core/scheduler.py, engine/worker/model_runner.py,
engine/core/engine_core.py) follow vLLM's order within a step: schedule (the scheduler side) ->
bind the metadata, start_load_kv, forward (wait_for_layer_load / save_kv_layer per layer),
wait_for_save, clear the metadata (the worker side) -> get_finished -> the scheduler frees the
blocks of finished sends.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvserve.engine.core.sequence import Sequence
    from kvserve.engine.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side hands the worker side for one step (each connector subclasses
    it); falsy when the step asks nothing of the worker side."""

    def __bool__(self) -> bool:
        return False


def kv_transfer_params(seq: "Sequence") -> dict[str, Any] | None:
    """A request's `kv_transfer_params` (vLLM keeps them in `SamplingParams.extra_args`)."""
    extra = getattr(seq.params, "extra_args", None) or {}
    params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """Subclass and register it (factory.py), or name it with kv_connector_module_path."""

    def __init__(self, config: "KVTransferConfig", role: KVConnectorRole,
                 engine: Any = None) -> None:
        """`engine`: what the engine knows that a connector may need (an `EngineInfo` of
        factory.py: model, block size, KV layout, tensor-parallel size)."""
        self.config = config
        self.role = role
        self.engine = engine
        self._metadata: KVConnectorMetadata | None = None

    # ---- worker side --------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def get_connector_metadata(self) -> KVConnectorMetadata | None:
        return self._metadata

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]") -> None:
        """This rank's KV cache, one tensor per layer `[2, num_blocks, block_size, kv_heads,
        head_dim]` (K and V; vLLM's flash layout) named `layers.{i}`, in layer order."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Begin loading the bound metadata's blocks into the KV cache (before the forward)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s loads are in place (called before its attention)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Begin saving one layer's KV (called after its attention wrote it)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves are done (after the forward)."""

    def get_finished(self, finished_req_ids: set[str] | None = None
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks were sent and may be freed, requests whose receive
        finished); None for none."""
        return None, None

    # ---- scheduler side -----------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Sequence", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """(tokens past `num_computed_tokens` the connector supplies, whether they load
        asynchronously); None for the count: not known yet, the request waits a step."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Sequence", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The blocks allocated for the request's external tokens (in prompt order)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's work for the worker side; resets the scheduler side's step state."""

    def update_connector_output(self, finished_sending: set[str] | None,
                                finished_recving: set[str] | None) -> None:
        """The worker side's `get_finished`, as the scheduler sees it."""

    def request_finished(self, request: "Sequence", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the request's blocks until `get_finished` names it, the kv_transfer_params
        of its output)."""
        return False, None

    def shutdown(self) -> None:
        """Stop threads and close sockets."""

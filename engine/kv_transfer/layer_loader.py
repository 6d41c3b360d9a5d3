"""`LayerLoader`: a step's pulled blocks written into the KV cache layer by layer on a thread
(on CUDA: on a side stream) while the forward runs; the forward waits for layer i only before
layer i's attention (KVConnectorBase_V1.wait_for_layer_load), and the step's end for all of it."""

from __future__ import annotations

import threading
from typing import Any

import torch

# (each rank's payload [layers, 2, n, per-block bytes] uint8, destination block ids)
Load = tuple[list[torch.Tensor], list[int]]


def scatter_layer(cache: torch.Tensor, layer: int, loads: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> None:
    """Layer `layer` of each (this rank's payload, destination index) into `cache` (that layer's
    cache as bytes, `[2, num_blocks, block_size, heads, head_dim x element size]`)."""
    for payload, idx in loads:
        src = payload[layer].view(2, idx.numel(), *cache.shape[2:])
        cache.index_copy_(1, idx, src.to(cache.device, non_blocking=True))


class LayerLoader:
    """Starts at once; `wait(i)` returns when layer i is in place (raising what the thread
    raised), `finish()` when every layer is."""

    def __init__(self, loads: list[Load], layers: list[torch.Tensor], rank: int) -> None:
        device = layers[0].device
        self._loads = [(payloads[rank], torch.tensor(dst, dtype=torch.int64, device=device))
                       for payloads, dst in loads]
        self._layers = layers
        self._ready = [threading.Event() for _ in layers]
        self._error: BaseException | None = None
        self._stream: Any = None
        self._events: list[Any] = []
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # after the moves
            self._events = [torch.cuda.Event() for _ in layers]
        self._thread = threading.Thread(target=self._run, name="kv-layer-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                for i, cache in enumerate(self._layers):
                    if self._stream is not None:
                        with torch.cuda.stream(self._stream):
                            scatter_layer(cache, i, self._loads)
                            self._events[i].record(self._stream)
                    else:
                        scatter_layer(cache, i, self._loads)
                    self._ready[i].set()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the forward's thread
            self._error = exc
            for ev in self._ready:
                ev.set()

    def wait(self, layer: int) -> None:
        self._ready[layer].wait()
        if self._error is not None:
            raise RuntimeError(f"loading pulled KV blocks failed: {self._error!r}") \
                from self._error
        if self._stream is not None:
            torch.cuda.current_stream(self._layers[0].device).wait_event(self._events[layer])

    def finish(self) -> None:
        self._thread.join()
        for i in range(len(self._layers)):
            self.wait(i)
        if self._stream is not None:  # the payloads and indices may be freed after this
            self._stream.synchronize()

"""LoRAManager (engine side): which adapters are known, which sit in host memory (an LRU of
`max_cpu_loras`) and which in the device slots of the batched op (an LRU of `max_loras`).

A slot is only reused for an adapter whose requests are all gone: the scheduler admits at
most `max_loras` adapters among the running requests, so the adapters of a step always fit.
The manager holds no model tensors; `load_slot` (the model runner's) copies an adapter into a
slot on every rank."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvserve.engine.errors import LoRAError, LoRANotFoundError
from kvserve.lora.adapter import LoRAWeights, load_adapter
from kvserve.lora.config import LoRAConfig
from kvserve.lora.request import LoRARequest

logger = logging.getLogger("kvserve.engine")

LoadSlot = Callable[[int, LoRAWeights | None], None]
Check = Callable[[LoRAWeights], None]


class LoRAManager:
    def __init__(self, config: LoRAConfig, load_slot: LoadSlot, check: Check) -> None:
        self.config = config
        self._load_slot, self._check = load_slot, check
        self.registry: dict[str, LoRARequest] = {}
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()  # LRU: oldest first
        self.slots: OrderedDict[str, int] = OrderedDict()  # name -> device slot, LRU order
        self.load_seconds: list[float] = []  # reading + checking each adapter from disk

    # ---- registry (vLLM's add_lora / remove_lora / list_loras) --------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Read and check the adapter and keep it in host memory; False if this very adapter is
        already known. LoRAError when it cannot be served."""
        known = self.registry.get(request.lora_name)
        if known is not None:
            if (known.lora_int_id, known.lora_path) == (request.lora_int_id, request.lora_path):
                return False
            raise LoRAError(f"the LoRA adapter {request.lora_name!r} is already loaded (from "
                            f"{known.lora_path!r}); unload it first", "lora_name")
        clash = [r.lora_name for r in self.registry.values()
                 if r.lora_int_id == request.lora_int_id]
        if clash:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already used by adapter "
                            f"{clash[0]!r}", "lora_int_id")
        weights = self._read(request)
        self.registry[request.lora_name] = request
        self._keep(request.lora_name, weights)
        return True

    def remove(self, name_or_id: str | int, busy: Iterable[str] = ()) -> bool:
        """Forget an adapter (False if unknown); LoRAError while requests still run on it."""
        name = self._name_of(name_or_id)
        if name is None:
            return False
        if name in set(busy):
            raise LoRAError(f"the LoRA adapter {name!r} has requests in flight; unload it once "
                            "they finish", "lora_name")
        del self.registry[name]
        self.host.pop(name, None)
        slot = self.slots.pop(name, None)
        if slot is not None:
            self._load_slot(slot, None)
        return True

    def list(self) -> list[LoRARequest]:
        return list(self.registry.values())

    def resident(self) -> list[str]:
        """Adapters held in memory (device slots first, then host), ready without a disk read."""
        return list(dict.fromkeys([*self.slots, *self.host]))

    def get(self, name: str) -> LoRARequest:
        request = self.registry.get(name)
        if request is None:
            raise LoRANotFoundError(f"the LoRA adapter {name!r} is not loaded")
        return request

    def _name_of(self, name_or_id: str | int) -> str | None:
        if isinstance(name_or_id, int):
            return next((r.lora_name for r in self.registry.values()
                         if r.lora_int_id == name_or_id), None)
        return name_or_id if name_or_id in self.registry else None

    # ---- residency ----------------------------------------------------------------------------
    def activate(self, names: Iterable[str], busy: Iterable[str]) -> dict[str, int]:
        """Slots for this step's adapters (loading the missing ones over the least recently used
        idle adapters); `busy`: the adapters of every running request, never evicted."""
        wanted = list(dict.fromkeys(names))
        keep = set(busy) | set(wanted)
        for name in wanted:
            if name in self.slots:
                self.slots.move_to_end(name)
                continue
            slot = self._free_slot(keep)
            self._load_slot(slot, self._weights(name))
            self.slots[name] = slot
        return {name: self.slots[name] for name in wanted}

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self.slots.values())
        free = [i for i in range(self.config.max_loras) if i not in used]
        if free:
            return free[0]
        victim = next((n for n in self.slots if n not in keep), None)
        if victim is None:  # the scheduler admits at most max_loras adapters: a bug if reached
            raise RuntimeError(f"all {self.config.max_loras} LoRA slots hold adapters with "
                               "running requests")
        return self.slots.pop(victim)

    def _weights(self, name: str) -> LoRAWeights:
        weights = self.host.get(name)
        if weights is None:  # dropped from host memory: read it again
            weights = self._read(self.registry[name])
        self._keep(name, weights)
        return weights

    def _keep(self, name: str, weights: LoRAWeights) -> None:
        self.host[name] = weights
        self.host.move_to_end(name)
        while len(self.host) > self.config.cpu_slots:
            self.host.popitem(last=False)

    def _read(self, request: LoRARequest) -> LoRAWeights:
        t0 = time.perf_counter()
        weights = load_adapter(request.lora_name, request.lora_path, self.config.max_lora_rank)
        self._check(weights)
        self.load_seconds.append(time.perf_counter() - t0)
        logger.info("LoRA adapter %s (rank %d, %d modules, %.1f MiB) read from %s",
                    request.lora_name, weights.rank, len(weights.modules),
                    weights.num_bytes / 2**20, request.lora_path)
        return weights

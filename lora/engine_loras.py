"""The engine's LoRA adapters: vLLM's add_lora / remove_lora / list_loras, each request's
adapter and each step's slots, over a `LoRAManager` (manager.py), or the refusals of an engine
started without enable_lora. Imports the manager (and torch's adapter code) only when enabled."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvserve.engine.errors import ConfigError, InvalidRequestError


class EngineLoRAs:
    """`manager`: the LoRAManager of enable_lora=True, None otherwise."""

    def __init__(self, manager: Any = None) -> None:
        self.manager = manager

    @classmethod
    def create(cls, config: Any, runner: Any) -> EngineLoRAs:
        """The adapters of an engine (`config`: EngineConfig) over its model runner."""
        if not config.enable_lora:
            return cls()
        from kvserve.lora.manager import LoRAManager

        return cls(LoRAManager(config.lora_config(), runner.load_lora,
                               lambda weights: runner.lora.resolve(weights)))

    def add(self, lora_request: Any) -> bool:
        """Read and check an adapter and keep it in host memory; False if already loaded.
        LoRAError (a 400) when it cannot be served; ConfigError without enable_lora."""
        return self._enabled().add(lora_request)

    def remove(self, name_or_id: str | int, busy: Iterable[str]) -> bool:
        """Forget an adapter by name or lora_int_id; False if unknown. LoRAError while
        requests (`busy`: the adapters of every request) still run on it."""
        return self._enabled().remove(name_or_id, set(busy))

    def list(self) -> list[Any]:
        """The LoRARequests of every loaded adapter."""
        return self.manager.list() if self.manager is not None else []

    def resident(self) -> list[str]:
        """Adapters held in memory (device slots, then host): what a replica publishes."""
        return self.manager.resident() if self.manager is not None else []

    def get(self, name: str) -> Any:
        """The loaded adapter called `name` (LoRANotFoundError: none)."""
        return self._enabled().get(name)

    def name_for(self, lora_request: Any) -> str | None:
        """The adapter name a new request runs with, read now if not yet known."""
        if lora_request is None:
            return None
        if self.manager is None:
            raise InvalidRequestError("this request names a LoRA adapter but the engine was "
                                      "started without enable_lora=True", "lora_request")
        self.manager.add(lora_request)
        return lora_request.lora_name

    def slots(self, names: list[str | None], running: Iterable[str]) -> list[int] | None:
        """Each scheduled seq's adapter slot (-1: base model), loading adapters into slots;
        None when no seq of the step has one. `running`: adapters of running requests."""
        if self.manager is None or not any(n is not None for n in names):
            return None
        slots = self.manager.activate([n for n in names if n is not None], running)
        return [slots[n] if n is not None else -1 for n in names]

    def _enabled(self) -> Any:
        if self.manager is None:
            raise ConfigError("LoRA adapters need an engine started with enable_lora=True "
                              "(kvserve serve --enable-lora)")
        return self.manager

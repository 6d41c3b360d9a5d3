"""LoRAConfig: how many adapters fit where, and the largest rank (fixed at start: the device
buffers of every wrapped linear are sized by it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.defaults import MAX_LORA_RANK
from kvserve.engine.errors import ConfigError

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted values


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters resident on the device at once (slots of the batched op)
    max_lora_rank: int = MAX_LORA_RANK
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ConfigError(f"max_lora_rank must be one of {MAX_LORA_RANKS}, got "
                              f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                              f"({self.max_loras})")

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

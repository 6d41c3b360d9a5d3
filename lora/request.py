"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

A plain picklable dataclass: it crosses process boundaries (tensor-parallel workers, an engine
core in its own process) unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` identifies the adapter everywhere (server `model`, router, prefix-cache keys);
    `lora_int_id` is vLLM's positive integer id; `lora_path` a PEFT adapter folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

"""The server's LoRA adapters (vLLM's OpenAIServingModels part): `--lora-modules` loaded at
start, `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` at runtime (only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING or KVSERVE_ALLOW_RUNTIME_LORA_UPDATING true), each adapter a
model name (`model: "<adapter>"`) listed in /v1/models with the base model as its parent.

The adapters themselves live in the engine (add_lora / remove_lora, run on the engine thread);
this keeps the names the server answers to and the LoRARequest each one maps to."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from kvserve.engine.errors import LoRAError, LoRANotFoundError
from kvserve.lora.request import LoRARequest
from kvserve.service.openai_errors import APIError
from kvserve.service.request_models import OpenAIModel

RUNTIME_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "KVSERVE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes") for k in RUNTIME_ENV)


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"bad JSON {text!r}: {exc}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(
                f'expected {{"name": ..., "path": ..., "base_model_name": ...}}, got {text!r}')
        return LoRAModulePath(value["name"], value["path"], value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)


AdapterName = Annotated[str, Field(min_length=1, max_length=256)]
AdapterPath = Annotated[str, Field(min_length=1, max_length=4096)]


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: AdapterName
    lora_path: AdapterPath


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: AdapterName
    lora_int_id: int | None = None


class LoRAModels:
    """Adapter name -> LoRARequest, with the engine (an AsyncEngine) holding the weights."""

    def __init__(self, engine: Any, base_model_names: list[str]) -> None:
        self.engine, self.base_names = engine, base_model_names
        self.requests: dict[str, LoRARequest] = {}
        self._next_id = 1

    def get(self, name: str | None) -> LoRARequest | None:
        return self.requests.get(name) if name is not None else None

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load into the engine; LoRAError (400) naming why it cannot be served."""
        if name in self.requests:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name in self.base_names:
            raise LoRAError(f"'{name}' is the base model's name; pick another lora_name",
                            "lora_name")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise LoRAError(f"adapter {name!r} is for base model {base_model_name!r}; this "
                            f"server serves {self.base_names}", "base_model_name")
        request = LoRARequest(name, self._next_id, path, base_model_name)
        await self.engine.add_lora(request)
        self._next_id += 1
        self.requests[name] = request
        return request

    async def unload(self, name: str) -> None:
        """LoRANotFoundError (404) for a name not loaded; LoRAError (400) while it serves."""
        if name not in self.requests:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        await self.engine.remove_lora(name)
        del self.requests[name]


def not_found(exc: LoRANotFoundError) -> APIError:
    return APIError(404, str(exc), param="lora_name", code="model_not_found")

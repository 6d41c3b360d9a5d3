"""spec.adapters: LoRA adapters of the served model. Where each one comes from and the path a
replica loads it from; the engine and router flags they add; the Job that fetches hub adapters
into the weights cache (engine pods mount it read-only, and an adapter added to a running
service must not restart them, so the pods' init container does not fetch adapters)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvserve.operator.spec import ServiceSpec

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
Obj = dict[str, Any]


def lora_enabled(spec: ServiceSpec) -> bool:
    return spec.lora.enabled or bool(spec.adapters)


def engine_args(spec: ServiceSpec) -> list[str]:
    """The engine's LoRA flags. The adapters themselves are not flags: they are loaded at run
    time (the router and the operator call the pods), so adding one changes no pod template."""
    if not lora_enabled(spec):
        return []
    return ["--enable-lora", "--max-loras", str(spec.lora.max_loras),
            "--max-lora-rank", str(spec.lora.max_lora_rank)]


def engine_env(spec: ServiceSpec) -> list[Obj]:
    return [{"name": RUNTIME_LORA_ENV, "value": "true"}] if lora_enabled(spec) else []


def router_args(spec: ServiceSpec) -> list[str]:
    """--lora-modules NAME=PATH ...: the router may have any replica load these."""
    if not spec.adapters:
        return []
    return ["--lora-modules", *(f"{a.name}={a.path}" for a in spec.adapters)]


def registry(spec: ServiceSpec) -> dict[str, str]:
    """{name: path} of every adapter the replicas should hold."""
    return {a.name: a.path for a in spec.adapters}


def fetch_job_name(spec: ServiceSpec) -> str | None:
    """`<service>-adapters-<hash>`: a Job's pod template cannot change, so another set of hub
    adapters is another Job (the old one is pruned). None when no adapter needs fetching."""
    hub = sorted((a.name, a.uri) for a in spec.adapters if a.fetched)
    if not hub:
        return None
    digest = hashlib.sha256(json.dumps(hub).encode()).hexdigest()[:8]
    return f"{spec.name}-adapters-{digest}"


def fetch_command(spec: ServiceSpec, weights_dir: str) -> list[str]:
    cmd = ["python", "-m", "kvserve.operator.fetch", "--cache", weights_dir]
    for a in spec.adapters:
        if a.fetched:
            loc = a.location
            cmd += ["--adapter", f"hf://{loc.path}:{loc.revision}"]
    return cmd

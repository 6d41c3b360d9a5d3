"""spec.adapters: LoRA adapters of the served model. Where each one comes from and the path a
replica loads it from; the engine and router flags they add; the Job that fetches hub adapters
into the weights cache (engine pods mount it read-only, and an adapter added to a running
service must not restart them, so the pods' init container does not fetch adapters)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.model_uri import ModelURI, parse_model_uri

if TYPE_CHECKING:
    from kvserve.operator.spec import ModelRef, ServiceSpec

# Where `kvserve.operator.fetch --adapter` puts a hub adapter inside the weights cache.
ADAPTERS_DIR = "adapters"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
Obj = dict[str, Any]


@dataclass(frozen=True)
class LoraSpec:
    enabled: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    uri: str  # as written in the spec (status echoes it)
    location: ModelURI
    path: str  # what a replica loads: POST /v1/load_lora_adapter {"lora_path": path}

    @property
    def fetched(self) -> bool:
        """A hub adapter: the fetch Job copies it into the weights cache first."""
        return self.location.scheme == "hf"


def parse_adapters(raw: list[dict], model: ModelRef, weights_dir: str) -> tuple[AdapterSpec, ...]:
    """spec.adapters as AdapterSpecs; InvalidSpecError names the adapter and what to change."""
    seen: set[str] = set()
    out = []
    for i, item in enumerate(raw):
        name, uri = item["name"], item["uri"]
        where = f"spec.adapters[{i}] ({name})"
        if name in seen:
            raise InvalidSpecError(f"{where}: the name is used twice", reason="InvalidAdapter")
        if name == model.served_name:
            raise InvalidSpecError(f"{where}: the name is the served model's own name; requests "
                                   "could not tell them apart", reason="InvalidAdapter")
        seen.add(name)
        try:
            location = parse_model_uri(uri)
        except InvalidSpecError as exc:
            raise InvalidSpecError(f"{where}: {exc}", reason="InvalidAdapter") from None
        out.append(AdapterSpec(name, uri, location, _path(where, location, model, weights_dir)))
    return tuple(out)


def _path(where: str, loc: ModelURI, model: ModelRef, weights_dir: str) -> str:
    if loc.scheme == "hf":
        if model.cache is None:
            raise InvalidSpecError(
                f"{where}: a hub adapter is fetched into the weights cache; set "
                "spec.model.cache (or put it on the model's claim: pvc://CLAIM/PATH)",
                reason="InvalidAdapter")
        return f"{weights_dir}/{ADAPTERS_DIR}/{loc.slug}"
    if loc.scheme == "pvc":
        claim = model.location.claim if model.location.scheme == "pvc" else \
            (model.cache.claim_name if model.cache is not None else "")
        if loc.claim != claim:
            raise InvalidSpecError(
                f"{where}: pvc://{loc.claim} is not the claim the engine pods mount "
                f"({claim or 'none'}): a new volume would restart them; copy the adapter to "
                "the model's claim", reason="InvalidAdapter")
        return f"{weights_dir}/{loc.path}".rstrip("/")
    if loc.scheme == "path" and loc.path.startswith("/"):
        return loc.path
    raise InvalidSpecError(f"{where}: write hf://ORG/NAME[:REVISION], pvc://CLAIM/PATH or an "
                           "absolute path inside the image", reason="InvalidAdapter")


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

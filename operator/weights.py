"""Where an engine pod gets its weights: a cache claim filled once by an init container, an
existing claim named by pvc://, or (neither) the engine's own download at start."""

from __future__ import annotations

from typing import Any

from kvserve.operator import trust
from kvserve.operator.spec import WEIGHTS_DIR, ServiceSpec

VOLUME = "weights"
Obj = dict[str, Any]


def uses_claim(spec: ServiceSpec) -> bool:
    return spec.model.cache is not None or spec.model.location.scheme == "pvc"


def model_path(spec: ServiceSpec) -> str:
    """What `kvserve serve` loads: the folder on the claim, else the catalog id / hub id."""
    loc = spec.model.location
    if loc.scheme == "pvc":
        return f"{WEIGHTS_DIR}/{loc.path}".rstrip("/")
    if spec.model.cache is not None:
        return f"{WEIGHTS_DIR}/models/{loc.slug}"  # where `kvserve fetch-model` puts it
    return spec.model.source


def serves_hub_revision(spec: ServiceSpec) -> bool:
    """The engine downloads from the hub itself (no claim): it needs --revision then."""
    return not uses_claim(spec) and spec.model.location.scheme == "hf"


def claim(spec: ServiceSpec, metadata: Obj) -> Obj | None:
    """The PersistentVolumeClaim the operator owns, when spec.model.cache.pvc asks for one."""
    cache = spec.model.cache
    if cache is None or not cache.create:
        return None
    body: Obj = {"accessModes": [cache.access_mode],
                 "resources": {"requests": {"storage": cache.size}}}
    if cache.storage_class:
        body["storageClassName"] = cache.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata,
            "spec": body}


def volume(spec: ServiceSpec) -> Obj | None:
    if spec.model.location.scheme == "pvc":
        return {"name": VOLUME, "persistentVolumeClaim": {"claimName": spec.model.location.claim,
                                                           "readOnly": True}}
    if spec.model.cache is not None:
        return {"name": VOLUME,
                "persistentVolumeClaim": {"claimName": spec.model.cache.claim_name}}
    return None


def engine_mount() -> Obj:
    """The engine reads the weights; only the init container may write them."""
    return {"name": VOLUME, "mountPath": WEIGHTS_DIR, "readOnly": True}


def fetch_command(spec: ServiceSpec) -> list[str]:
    loc = spec.model.location
    uri = f"hf://{loc.path}" if loc.scheme == "hf" else loc.path
    return ["python", "-m", "kvserve.operator.fetch", "--uri", uri, "--revision", loc.revision,
            "--cache", WEIGHTS_DIR]


def init_container(spec: ServiceSpec, security: Obj, scratch: list[Obj]) -> Obj | None:
    """Fills the cache claim once; a current marker file makes it exit at once."""
    if spec.model.cache is None:
        return None
    ref = spec.model.token_secret
    token = [] if ref is None else [trust.secret_env("HF_TOKEN", ref)]
    env = [{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "XDG_CACHE_HOME", "value": "/tmp"},
           *token, *spec.env]
    return {"name": "fetch-weights", "image": spec.image, "command": fetch_command(spec),
            "env": env, "securityContext": security,
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                          "limits": {"memory": "4Gi"}},
            "volumeMounts": [*scratch, {"name": VOLUME, "mountPath": WEIGHTS_DIR}]}

"""Size a model from its own files at reconcile time: config.json and the safetensors headers of
a hub repo (through `HF_ENDPOINT`, with a token from the Secret spec.model.tokenSecretRef names),
or of a local folder (`kvserve plan`). Answers are cached a while, so a resync timer does not
re-read the hub every 30 s, and failures are cached shorter, so a broken model cannot loop hot.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.sizing.hub_weights import hub_endpoint, read_checkpoint
from kvserve.engine.sizing.weights_size import CheckpointReadError
from kvserve.operator.catalog import ModelArch, arch_from_checkpoint
from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.model_uri import ModelURI
from kvserve.operator.trust import SecretRef

HF_TOKEN_ENV = "HF_TOKEN"
OK_TTL_S = 600.0
ERROR_TTL_S = 60.0


class ModelReadError(InvalidSpecError):
    """The model's files could not be read: never a guessed size. `transient`: retry later
    (network, 5xx, a Secret not there yet); otherwise the spec must change (404, gated)."""

    def __init__(self, message: str, reason: str, transient: bool) -> None:
        super().__init__(message, reason=reason)
        self.transient = transient


def env_value(env: list[dict[str, Any]], name: str) -> str | None:
    """A literal value the spec's env sets (HF_ENDPOINT in spec.env wins over the operator's)."""
    return next((e.get("value") for e in env if e.get("name") == name and "value" in e), None)


@dataclass
class ModelReader:
    """Reads (and caches) model files for sizing; `kube` reads token Secrets (None: no Secrets,
    the token comes from HF_TOKEN, as for `kvserve plan`)."""

    kube: Any = None
    use_hf_cache: bool = False  # `kvserve plan`: a hub model already in the HF cache is read there
    ok_ttl_s: float = OK_TTL_S
    error_ttl_s: float = ERROR_TTL_S
    _cache: dict[tuple, tuple[float, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def arch(self, location: ModelURI, namespace: str, token_ref: SecretRef | None = None,
             env: list[dict[str, Any]] | None = None) -> ModelArch:
        """The model's ModelArch from its files; ModelReadError says what failed."""
        if location.scheme == "pvc":
            raise ModelReadError(
                f"the operator cannot read pvc://{location.claim}/{location.path} to size it; "
                "name a catalog model (spec.model.name) or give spec.model.architecture",
                "ModelUnreadable", transient=False)
        endpoint = hub_endpoint(env_value(env or [], "HF_ENDPOINT")
                                or os.environ.get("HF_ENDPOINT"))
        token = self._token(namespace, token_ref)
        digest = hashlib.sha256((token or "").encode()).hexdigest()[:12]
        key = (location.scheme, location.path, location.revision, endpoint, digest)
        return self._cached(key, lambda: self._read(location, token, endpoint,
                                                    self.use_hf_cache))

    def _cached(self, key: tuple, read: Any) -> ModelArch:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            if isinstance(hit[1], ModelReadError):
                raise hit[1]
            return hit[1]
        try:
            value = read()
        except ModelReadError as exc:
            with self._lock:
                self._cache[key] = (now + self.error_ttl_s, exc)
            raise
        with self._lock:
            self._cache[key] = (now + self.ok_ttl_s, value)
        return value

    @staticmethod
    def _read(location: ModelURI, token: str | None, endpoint: str,
              use_hf_cache: bool) -> ModelArch:
        try:
            checkpoint = read_checkpoint(location.path, location.revision, token, endpoint,
                                         use_cache=use_hf_cache)
        except CheckpointReadError as exc:
            raise ModelReadError(f"cannot size {location.path!r} from its files: {exc}",
                                 exc.reason, exc.transient) from exc
        return arch_from_checkpoint(checkpoint, location.path)

    def _token(self, namespace: str, ref: SecretRef | None) -> str | None:
        if ref is None:
            return os.environ.get(HF_TOKEN_ENV) or None
        if self.kube is None:
            raise ModelReadError(f"spec.model.tokenSecretRef {ref.name} names a Secret, but "
                                 "there is no cluster to read it from; set HF_TOKEN instead",
                                 "ModelTokenUnavailable", transient=False)
        secret = self.kube.get("v1", "Secret", namespace, ref.name)
        value = ((secret or {}).get("data") or {}).get(ref.key)
        if value is None:
            raise ModelReadError(
                f"Secret {namespace}/{ref.name} (spec.model.tokenSecretRef) "
                f"{'has no key ' + repr(ref.key) if secret else 'does not exist'}; create it "
                f"with the hub token: kubectl create secret generic {ref.name} "
                f"--from-literal={ref.key}=hf_...", "ModelTokenUnavailable", transient=True)
        return base64.b64decode(value).decode().strip()

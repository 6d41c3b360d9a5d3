"""What a replica's heartbeat tells the router (URL, model, block size, load, draining, resident
LoRA adapters, prefill/decode role) and the registration signature that proves the replica holds
the service's shared token."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# The heartbeat hash's fields (service/prefix_index/keys.py), in the order the lookup returns them.
INFO_FIELDS = ("url", "model", "block_size", "num_running", "num_waiting", "kv_cache_usage",
               "heartbeat_at", "draining", "signature", "adapters", "role")
# `draining` = "1" while the replica drains (SIGTERM): routers stop sending to it at once.
DRAINING_FIELD = "draining"
DRAINING_VALUE = "1"
# HMAC-SHA256 (hex) of `signed_message(...)` under KVSERVE_REGISTRATION_TOKEN.
SIGNATURE_FIELD = "signature"
REGISTRATION_TOKEN_ENV = "KVSERVE_REGISTRATION_TOKEN"
# `adapters` = a JSON list of the LoRA adapter names the replica holds now (absent in heartbeats of
# replicas without LoRA, or from before the field existed: read as none).
ADAPTERS_FIELD = "adapters"
# `role` = what the replica does in prefill/decode disaggregation, from its --kv-transfer-config's
# kv_role: "prefill" (kv_producer), "decode" (kv_consumer) or "both" (kv_both, or no connector).
# Absent (a replica from before the field, or without a connector) reads as "both".
ROLE_FIELD = "role"
ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH = "prefill", "decode", "both"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH)
# Field values a replica could plausibly send; anything larger is garbage, not a heartbeat.
_MAX_FIELD_CHARS = 2048
# The adapter list is longer: a replica may hold hundreds of adapters in host memory.
_MAX_ADAPTERS_CHARS = 1 << 16


class MalformedHeartbeatError(ValueError):
    """A heartbeat hash whose fields are not what a kvserve replica writes."""


def signed_message(replica_id: str, url: str, heartbeat_at: str) -> bytes:
    """What a heartbeat's signature covers: the id and URL (so a stolen signature cannot send
    traffic elsewhere) and the timestamp string exactly as stored."""
    return "\n".join((replica_id, url, heartbeat_at)).encode()


def sign_heartbeat(token: str, replica_id: str, url: str, heartbeat_at: str) -> str:
    return hmac.new(token.encode(), signed_message(replica_id, url, heartbeat_at),
                    hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica's last heartbeat said."""

    replica_id: str
    url: str
    model: str
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    heartbeat_at: float = 0.0
    draining: bool = False
    heartbeat_at_raw: str = ""  # the stored string, which the signature covers
    signature: str = ""
    adapters: frozenset[str] = frozenset()  # LoRA adapters resident on the replica
    role: str = ROLE_BOTH  # prefill, decode or both (ROLE_FIELD)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    def signed_by(self, token: str) -> bool:
        """True when the heartbeat carries a valid signature under `token`."""
        expected = sign_heartbeat(token, self.replica_id, self.url, self.heartbeat_at_raw)
        return hmac.compare_digest(expected, self.signature)

    @classmethod
    def from_fields(cls, replica_id: str, values: Sequence[Any]) -> ReplicaInfo:
        """From the heartbeat hash's values in INFO_FIELDS order (bytes or str, as Redis gives);
        MalformedHeartbeatError for anything a replica would not write."""
        if len(values) != len(INFO_FIELDS):
            raise MalformedHeartbeatError(f"expected {len(INFO_FIELDS)} fields, got {len(values)}")
        f = {name: _text(v, _MAX_ADAPTERS_CHARS if name == ADAPTERS_FIELD else _MAX_FIELD_CHARS)
             for name, v in zip(INFO_FIELDS, values)}
        url = f["url"]
        if not _is_http_url(url):
            raise MalformedHeartbeatError(f"url {url[:80]!r} is not http(s)://host[:port]")
        return cls(
            replica_id=replica_id, url=url, model=f["model"],
            block_size=_int(f, "block_size", 16, low=1), num_running=_int(f, "num_running", 0),
            num_waiting=_int(f, "num_waiting", 0),
            kv_cache_usage=_float(f, "kv_cache_usage"), heartbeat_at=_float(f, "heartbeat_at"),
            draining=f["draining"] == DRAINING_VALUE, heartbeat_at_raw=f["heartbeat_at"],
            signature=f["signature"], adapters=parse_adapters(f[ADAPTERS_FIELD]),
            role=parse_role(f[ROLE_FIELD]))


def parse_role(text: str) -> str:
    """A heartbeat's role ("" = both); MalformedHeartbeatError for anything else."""
    if not text:
        return ROLE_BOTH
    if text not in ROLES:
        raise MalformedHeartbeatError(f"role {text[:40]!r} is not one of {', '.join(ROLES)}")
    return text


def role_of_kv_role(kv_role: str | None) -> str:
    """The heartbeat role of a connector's kv_role (vLLM's names): kv_producer -> prefill,
    kv_consumer -> decode, kv_both or none -> both."""
    return {"kv_producer": ROLE_PREFILL, "kv_consumer": ROLE_DECODE}.get(kv_role or "", ROLE_BOTH)


def encode_adapters(names: Iterable[str]) -> str:
    """The heartbeat's `adapters` value: a sorted JSON list (so an unchanged set writes the same
    string)."""
    return json.dumps(sorted(set(names)), separators=(",", ":"))


def parse_adapters(text: str) -> frozenset[str]:
    """The adapter names of a heartbeat's `adapters` value ("" = none)."""
    if not text:
        return frozenset()
    try:
        names = json.loads(text)
    except ValueError:
        raise MalformedHeartbeatError(f"adapters {text[:40]!r} is not a JSON list") from None
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise MalformedHeartbeatError("adapters is not a JSON list of adapter names")
    return frozenset(names)


@functools.lru_cache(maxsize=4096)
def _is_http_url(url: str) -> bool:
    """Cached: a router re-reads every replica's URL every second, and it rarely changes."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _text(value: Any, limit: int = _MAX_FIELD_CHARS) -> str:
    if value is None:
        return ""
    text = value.decode() if isinstance(value, bytes) else str(value)  # UnicodeDecodeError: bad
    if len(text) > limit:
        raise MalformedHeartbeatError(f"a field of {len(text)} characters")
    return text


def _int(f: dict[str, str], name: str, default: int, low: int = 0) -> int:
    try:
        value = int(f[name]) if f[name] else default
    except ValueError:
        raise MalformedHeartbeatError(f"{name} {f[name][:40]!r} is not an integer") from None
    if not low <= value < 1 << 31:
        raise MalformedHeartbeatError(f"{name} {value} is out of range")
    return value


def _float(f: dict[str, str], name: str) -> float:
    try:
        value = float(f[name]) if f[name] else 0.0
    except ValueError:
        raise MalformedHeartbeatError(f"{name} {f[name][:40]!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise MalformedHeartbeatError(f"{name} {value} is not a finite non-negative number")
    return value

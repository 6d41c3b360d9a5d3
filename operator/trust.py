"""Secrets a service runs with, kept out of its spec, args and the operator's logs.

The Redis password comes from a Secret the user names (`spec.redis.passwordSecretRef`); the
registration token replicas and routers share comes from a Secret the operator creates once.
Both reach the pods only as `valueFrom.secretKeyRef` env, never as a flag (flags show in
`ps` and in the pod spec).
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

REDIS_PASSWORD_ENV = "KVSERVE_REDIS_PASSWORD"
REGISTRATION_TOKEN_ENV = "KVSERVE_REGISTRATION_TOKEN"
REGISTRATION_KEY = "token"  # the key in the <name>-registration Secret
# scheme://user:password@ -> scheme://user:***@ (user may be empty, as in redis://:pw@host)
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):[^\s/]*@")


def redact(text: str) -> str:
    """text with the password of every URL in it replaced by ***."""
    return _USERINFO.sub(r"\1:***@", text)


class RedactingFilter(logging.Filter):
    """A handler filter: the formatted message of every record, redacted (a URL with a password
    that reaches a log line through an exception or a library's own message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_log_redaction() -> None:
    """The filter on every root handler, and on kopf's per-object logger, whose records also
    become Kubernetes events through a handler of its own."""
    targets: list = list(logging.getLogger().handlers) + [logging.getLogger("kopf.objects")]
    for target in targets:
        if not any(isinstance(f, RedactingFilter) for f in target.filters):
            target.addFilter(RedactingFilter())


def password_in_url(url: str | None) -> bool:
    """True for a URL that carries a password (redis://:pw@host, redis://user:pw@host)."""
    return bool(url) and urlsplit(url).password is not None


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str


def secret_env(name: str, ref: SecretRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def registration_secret_name(service: str) -> str:
    return f"{service}-registration"


def registration_ref(service: str) -> SecretRef:
    return SecretRef(registration_secret_name(service), REGISTRATION_KEY)


def new_token() -> str:
    return secrets.token_hex(32)


def registration_secret(metadata: dict, token: str) -> dict[str, Any]:
    """Created once (never rotated by a reconcile; kept when present): a new token would lock
    out every running replica until it restarts."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
            "stringData": {REGISTRATION_KEY: token}}

"""Opening Redis the same way in every component: the password from the URL or, when the URL has
none, from `KVSERVE_REDIS_PASSWORD` (a Kubernetes Secret), and URLs redacted before logging."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis

REDIS_PASSWORD_ENV = "KVSERVE_REDIS_PASSWORD"

# user:pass@ or :pass@ after the scheme, in any URL inside a log line.
_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.\-]*://)[^/@\s]*@", re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """`url` with any user:password@ replaced by ***@ (for log lines and errors)."""
    if not url:
        return "-"
    return _CREDENTIALS.sub(lambda m: m.group("scheme") + "***@", url)


def password_from_env(url: str) -> str | None:
    """The env password, used only when the URL carries none (the URL wins)."""
    if urlsplit(url).password:
        return None
    return os.environ.get(REDIS_PASSWORD_ENV) or None


def async_redis(url: str, timeout: float, **kwargs: Any) -> aioredis.Redis:
    """An asyncio Redis client for `url` with the env password applied."""
    password = password_from_env(url)
    if password is not None:
        kwargs["password"] = password
    return aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                   **kwargs)

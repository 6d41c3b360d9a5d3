"""Endpoints as the GIE protocol writes them (`ip:port`), and the replica URLs the router uses."""

from __future__ import annotations

from urllib.parse import urlsplit


class EndpointError(ValueError):
    """An endpoint that is not `host:port`."""


def parse_endpoint(text: str) -> str:
    """`host:port` (an IPv6 host in brackets) checked; EndpointError naming the bad one."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"endpoint {text!r} is not host:port")
    return text


def parse_endpoints(text: str) -> tuple[str, ...]:
    """A comma-separated `host:port,...` list, in order, without duplicates."""
    out = [parse_endpoint(item) for item in text.split(",") if item.strip()]
    return tuple(dict.fromkeys(out))


def endpoint_url(endpoint: str) -> str:
    """The replica URL the router keys a static endpoint by."""
    return f"http://{endpoint}"


def endpoint_of(url: str) -> str:
    """`host:port` of a replica URL (a heartbeat's advertise URL, or a static one)."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"

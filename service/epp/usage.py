"""Prompt and completion tokens from a response body as it streams past: the `usage` object of a
JSON answer, or of the SSE chunk that carries it (`stream_options.include_usage`)."""

from __future__ import annotations

import json
from typing import Any

_MAX_JSON = 4 << 20  # a non-streamed body larger than this is not parsed for usage


class UsageReader:
    """Fed the response body chunk by chunk; `usage` is the last usage object seen."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.usage: dict[str, Any] | None = None
        self._buf = bytearray()

    def feed(self, chunk: bytes, end: bool) -> None:
        if len(self._buf) + len(chunk) <= _MAX_JSON:
            self._buf += chunk
        if self.streaming:
            self._events(end)
        elif end:
            self._take(bytes(self._buf))
            self._buf.clear()

    def _events(self, end: bool) -> None:
        """Parse each complete SSE line; keep the unfinished tail for the next chunk."""
        *lines, tail = bytes(self._buf).split(b"\n")
        self._buf = bytearray(b"" if end else tail)
        for line in lines + ([tail] if end else []):
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                self._take(line[5:])

    def _take(self, raw: bytes) -> None:
        try:
            obj = json.loads(raw)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens; zeros when no usage was seen."""
        u = self.usage or {}
        return _int(u.get("prompt_tokens")), _int(u.get("completion_tokens"))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0

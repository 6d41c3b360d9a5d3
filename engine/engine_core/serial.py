"""Messages to bytes and back: pickle (protocol 5) of the plain dataclasses in messages.py.

Measured against the alternatives in docs/perf/server.md (a step of 256 streams is well under
a millisecond each way). An exception that does not survive pickling travels as a
`RemoteEngineError` carrying its type name and message."""

from __future__ import annotations

import pickle
from typing import Any

from kvserve.engine.errors import KVServeError


class RemoteEngineError(KVServeError):
    """An error raised in the engine core whose own type could not be sent across."""


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes | memoryview) -> Any:
    return pickle.loads(data)


def portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles and unpickles to the same type, else a RemoteEngineError naming it."""
    try:
        if type(pickle.loads(pickle.dumps(exc))) is type(exc):
            return exc
    except Exception:  # noqa: BLE001 - any failure means: send a stand-in
        pass
    return RemoteEngineError(f"{type(exc).__name__}: {exc}")

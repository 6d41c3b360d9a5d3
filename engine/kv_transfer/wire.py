"""KVServeConnector's wire format: a message is a 4-byte big-endian length and a JSON object;
a layer of blocks follows a `read` reply as one raw frame (8-byte length, then the bytes of
`[2, n, block_size, kv_heads, head_dim]` in the cache dtype). `KVLayout` is what the handshake
compares: two engines exchange blocks only when every field agrees."""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import asdict, dataclass
from typing import Any

PROTOCOL = "kvserve-kv/1"
_HEADER = struct.Struct(">I")
_FRAME = struct.Struct(">Q")
MAX_MESSAGE = 1 << 24  # a JSON message (block id lists) never comes near this


class TransferError(RuntimeError):
    """A transfer that did not complete (peer gone, refused, timed out); the request falls back
    to computing its prompt locally."""

    def __init__(self, message: str, reason: str = "transfer") -> None:
        super().__init__(message)
        self.reason = reason  # handshake | refused | connect | transfer


@dataclass(frozen=True)
class KVLayout:
    """What must match between a prefill and a decode engine for blocks to mean the same."""

    model: str  # the model's name (the last part of its path or hub id)
    architecture: str
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    block_size: int
    kv_dtype: str  # torch dtype name of the cache
    tp_size: int
    protocol: str = PROTOCOL

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def layer_bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype_size(self.kv_dtype)


_FLAGS = {"model": "--model", "block_size": "--block-size", "kv_dtype": "--kv-cache-dtype / "
          "--dtype", "tp_size": "--tensor-parallel-size", "num_kv_heads": "--tensor-parallel-size"}


def layout_mismatch(here: KVLayout, there: dict[str, Any]) -> str | None:
    """Why blocks of `there` (a peer's layout) cannot be used `here`, or None when they can."""
    diffs = []
    for key, mine in here.to_json().items():
        theirs = there.get(key)
        if theirs != mine:
            flag = _FLAGS.get(key)
            hint = f" (run both with the same {flag})" if flag else ""
            diffs.append(f"{key} {theirs!r} there, {mine!r} here{hint}")
    if not diffs:
        return None
    return "KV layouts differ: " + "; ".join(diffs)


def dtype_size(name: str) -> int:
    return {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2,
            "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1}.get(name, 4)


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if n > MAX_MESSAGE:
        raise TransferError(f"a message of {n} bytes: not a KVServeConnector peer", "handshake")
    try:
        out = json.loads(recv_exact(sock, n))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TransferError("an unreadable message: not a KVServeConnector peer",
                            "handshake") from None
    if not isinstance(out, dict):
        raise TransferError("a message that is not an object", "handshake")
    return out


def send_frame(sock: socket.socket, data: memoryview | bytes) -> None:
    sock.sendall(_FRAME.pack(len(data)))
    sock.sendall(data)


def recv_frame_into(sock: socket.socket, out: memoryview) -> None:
    """One raw frame into `out`, which must be exactly its size."""
    (n,) = _FRAME.unpack(recv_exact(sock, _FRAME.size))
    if n != len(out):
        raise TransferError(f"a layer of {n} bytes, {len(out)} expected", "transfer")
    got = 0
    while got < n:
        k = sock.recv_into(out[got:], n - got)
        if k == 0:
            raise TransferError(f"the peer closed the connection after {got} of {n} bytes of a "
                                "layer", "transfer")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError("the peer closed the connection", "transfer")
        got += k
    return bytes(buf)

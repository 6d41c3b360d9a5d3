"""The prefill side of KVServeConnector: `SendRegistry` (the finished requests whose blocks a
decode replica may still pull, each until it confirms or its deadline passes) and
`BlockServer`, a listener thread per engine that answers the handshake and streams the asked
blocks of a registered request layer by layer, straight from the live KV cache: as TCP frames, or
(a consumer on the same host, engine/kv_transfer/shm.py) into a shared-memory segment of its pool,
each layer named on the socket once written."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.kv_transfer.shm import SegmentPool, host_id
from kvserve.engine.kv_transfer.wire import (KVLayout, TransferError, layout_mismatch,
                                             recv_message, send_frame, send_message)

logger = logging.getLogger("kvserve.engine")
# Fault injection for the tests: after sending half of a request's layers the server touches
# this file and stalls, so a test can kill the process in the middle of a transfer.
FAULT_STALL_FILE = "KVSERVE_KV_FAULT_STALL_FILE"
IDLE_TIMEOUT_S = 300.0


@dataclass
class _Held:
    block_ids: frozenset[int]
    deadline: float


class SendRegistry:
    """Thread-safe: the scheduler holds, the listener threads confirm, the step loop takes
    the released (confirmed, or past their deadline)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: set[str] = set()
        self.num_expired = 0

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._held[request_id] = _Held(frozenset(block_ids), time.monotonic() + self.timeout_s)

    def check(self, request_id: str, block_ids: list[int]) -> str | None:
        """Why `block_ids` of `request_id` cannot be served now, or None."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or request_id in self._released:
                return (f"request {request_id!r} holds no blocks here (never prefilled here, "
                        "already pulled, or freed after the abort timeout)")
            if not held.block_ids.issuperset(block_ids):
                return f"block ids {sorted(set(block_ids) - held.block_ids)} are not request " \
                       f"{request_id!r}'s"
        return None

    def confirm(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._held:
                self._released.add(request_id)

    def take_released(self) -> set[str]:
        """Requests whose blocks may be freed now: confirmed or past their deadline."""
        now = time.monotonic()
        with self._lock:
            expired = {r for r, h in self._held.items() if h.deadline <= now} - self._released
            if expired:
                self.num_expired += len(expired)
                logger.warning("KV transfer: %d request(s) never pulled within %.0f s; their "
                               "blocks are freed (abort_request_timeout)", len(expired),
                               self.timeout_s)
            out = self._released | expired
            for r in out:
                self._held.pop(r, None)
            self._released = set()
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class BlockServer:
    """Serves one rank's KV cache on `host:port` (port 0: any free port, read `.port`)."""

    def __init__(self, layout: KVLayout, engine_id: str, layers: list[torch.Tensor],
                 registry: SendRegistry | None, host: str, port: int,
                 transports: tuple[str, ...] = ("tcp",)) -> None:
        self.layout, self.engine_id = layout, engine_id
        self.transports = transports  # what this side serves: tcp and/or shm
        self.host_id = host_id()
        self.pool = SegmentPool()
        self.layers = [_raw(t) for t in layers]  # [2, num_blocks, block_size, heads, dim] each
        self.registry = registry  # None on ranks > 0: rank 0 checks the request
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.num_blocks_sent = 0
        self.bytes_sent = 0
        self.bytes_by_transport = {"tcp": 0, "shm": 0}
        self.rank_ports = [self.port]  # rank 0's: every tensor-parallel rank's server, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kv-block-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self.pool.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-block-send",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(IDLE_TIMEOUT_S)  # a peer gone silent does not keep a thread forever
        try:
            with conn:
                while True:
                    msg = recv_message(conn)
                    if not self._answer(conn, msg):
                        return
        except (TransferError, OSError) as exc:
            logger.debug("KV block server: connection ended: %s", exc)

    def _answer(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        op = msg.get("op")
        if op == "hello":
            why = layout_mismatch(self.layout, msg.get("layout") or {})
            send_message(conn, {"ok": why is None, "error": why, "engine_id": self.engine_id,
                                "layout": self.layout.to_json(), "rank_ports": self.rank_ports,
                                "host_id": self.host_id, "transports": list(self.transports)})
            if why is not None:
                logger.warning("KV transfer refused at handshake from engine %s: %s",
                               msg.get("engine_id"), why)
            return why is None
        if op == "read":
            return self._send_blocks(conn, str(msg.get("request_id")),
                                     [int(b) for b in msg.get("block_ids") or []],
                                     str(msg.get("transport") or "tcp"))
        if op == "done":
            if self.registry is not None:
                self.registry.confirm(str(msg.get("request_id")))
            send_message(conn, {"ok": True})
            return True
        send_message(conn, {"ok": False, "error": f"unknown op {op!r}"})
        return False

    def _send_blocks(self, conn: socket.socket, request_id: str, block_ids: list[int],
                     transport: str = "tcp") -> bool:
        why = self.registry.check(request_id, block_ids) if self.registry is not None else None
        if why is None and any(not 0 <= b < self.layers[0].shape[1] for b in block_ids):
            why = f"block ids out of range 0..{self.layers[0].shape[1] - 1}"
        if why is None and transport not in self.transports:
            why = f"transport {transport!r} not served here (this side serves " \
                  f"{list(self.transports)}: kv_connector_extra_config.transport)"
        if why is not None:
            send_message(conn, {"ok": False, "error": why, "num_layers": len(self.layers)})
            return False
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.layers[0].device)
        if transport == "shm":
            sent = self._send_shm(conn, idx)
        else:
            send_message(conn, {"ok": True, "num_layers": len(self.layers)})
            sent = self._send_frames(conn, idx)
        if sent is None:
            return False
        self.num_blocks_sent += len(block_ids)
        nbytes = len(block_ids) * self.layout.layer_bytes_per_block * len(self.layers)
        self.bytes_sent += nbytes
        self.bytes_by_transport[sent] += nbytes
        return True

    def _send_frames(self, conn: socket.socket, idx: torch.Tensor) -> str:
        for i, layer in enumerate(self.layers):  # one layer gathered while the last is sent
            _maybe_stall(i, len(self.layers))
            data = layer.index_select(1, idx).contiguous().cpu()
            send_frame(conn, memoryview(data.numpy()).cast("B"))
        return "tcp"

    def _send_shm(self, conn: socket.socket, idx: torch.Tensor) -> str | None:
        """The blocks through a segment of the pool the consumer maps: each layer written, then
        named (`{"layer": i}`); the segment goes back to the pool once the consumer says it
        has copied them out. A consumer that cannot map it may ask for TCP frames instead."""
        n, first = int(idx.numel()), self.layers[0]
        shape = (len(self.layers), 2, n, first[0, 0].numel())
        nbytes = shape[0] * shape[1] * n * shape[3]
        seg = self.pool.take(nbytes)
        done = False
        try:
            send_message(conn, {"ok": True, "num_layers": len(self.layers),
                                "segment": seg.ref.to_json()})
            mapped = recv_message(conn)
            if not mapped.get("ok"):
                done = True
                if mapped.get("tcp") and "tcp" in self.transports:
                    return self._send_frames(conn, idx)
                return None
            out = seg.tensor(nbytes).view(shape)
            for i, layer in enumerate(self.layers):
                _maybe_stall(i, len(self.layers))
                dst = out[i].view(2, n, *layer.shape[2:])
                if layer.device.type == "cpu":
                    torch.index_select(layer, 1, idx, out=dst)
                else:
                    dst.copy_(layer.index_select(1, idx))
                send_message(conn, {"layer": i})
            done = recv_message(conn).get("op") == "copied"
            return "shm" if done else None
        finally:
            if done:  # nobody reads it any more
                self.pool.give(seg)
            else:  # a reader that broke off may still read it: not reused (its own mapping
                seg.close()  # keeps the memory until it lets go)


def _maybe_stall(layer: int, num_layers: int) -> None:
    """The tests' fault injection (FAULT_STALL_FILE): stall after half the layers."""
    stall = os.environ.get(FAULT_STALL_FILE)
    if stall and layer == num_layers // 2:
        Path(stall).touch()
        time.sleep(3600)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The cache as bytes (numpy has neither fp8 nor bf16; a copy moves bits, nothing is
    converted): the last dim becomes head_dim x element size."""
    return t.view(torch.uint8)

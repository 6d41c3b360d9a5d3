"""The decode side of KVServeConnector: `fetch_blocks` pulls a request's blocks from the prefill
engine's `BlockServer` (handshake, then one frame per layer straight into a host buffer, then the
confirmation that lets the prefill side free them). Runs on a thread of the scheduler side, so the
engine keeps stepping while a transfer is on the wire."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from kvserve.engine.kv_transfer.wire import (KVLayout, TransferError, layout_mismatch,
                                             recv_frame_into, recv_message, send_message)


@dataclass(frozen=True)
class Remote:
    """Where a request's blocks are: vLLM's kv_transfer_params of the prefill's output."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    tp_size: int


def fetch_shards(remote: Remote, request_id: str, block_ids: list[int], layout: KVLayout,
                 engine_id: str, timeout_s: float) -> list[torch.Tensor]:
    """Every tensor-parallel rank's bytes of `block_ids` (rank 0's server names the others'
    ports at the handshake), then the confirmation to rank 0; TransferError as fetch_blocks."""
    ports: list[int] = []
    first = fetch_blocks(remote, request_id, block_ids, layout, engine_id, timeout_s,
                         confirm=remote.tp_size == 1, rank_ports=ports)
    shards = [first]
    for rank in range(1, remote.tp_size):
        if len(ports) != remote.tp_size:
            raise TransferError(f"the prefill engine {remote.engine_id} named {len(ports)} "
                                f"rank ports for tp_size {remote.tp_size}", "handshake")
        shard = Remote(remote.engine_id, remote.host, ports[rank], remote.block_ids,
                       remote.tp_size)
        shards.append(fetch_blocks(shard, request_id, block_ids, layout, engine_id, timeout_s,
                                   confirm=False))
    if remote.tp_size > 1:
        confirm_only(remote, request_id, timeout_s)
    return shards


def fetch_blocks(remote: Remote, request_id: str, block_ids: list[int], layout: KVLayout,
                 engine_id: str, timeout_s: float, confirm: bool = True,
                 rank_ports: list[int] | None = None) -> torch.Tensor:
    """The bytes of `block_ids` as `[layers, 2, n, block_size, kv_heads, head_dim x element
    size]` uint8 (one rank's); TransferError when the peer is gone, refuses, or stops
    mid-transfer. `confirm`: tell the peer it may free them; `rank_ports` gets the ports of
    every rank's server, as the handshake names them."""
    try:
        sock = socket.create_connection((remote.host, remote.port), timeout=timeout_s)
    except OSError as exc:
        raise TransferError(f"cannot reach the prefill engine {remote.engine_id} at "
                            f"{remote.host}:{remote.port}: {exc}", "connect") from None
    try:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ports = _handshake(sock, remote, layout, engine_id)
            if rank_ports is not None:
                rank_ports[:] = ports
            send_message(sock, {"op": "read", "request_id": request_id, "block_ids": block_ids})
            reply = recv_message(sock)
            if not reply.get("ok"):
                raise TransferError(f"the prefill engine {remote.engine_id} refused the read: "
                                    f"{reply.get('error')}", "refused")
            per_block = layout.layer_bytes_per_block // 2  # K or V of one block, in bytes
            out = torch.empty((layout.num_layers, 2, len(block_ids), per_block),
                              dtype=torch.uint8)
            for layer in range(layout.num_layers):
                recv_frame_into(sock, memoryview(out[layer].numpy()).cast("B"))
            if confirm:
                send_message(sock, {"op": "done", "request_id": request_id})
                recv_message(sock)
    except OSError as exc:  # a timeout or a reset: the peer died or stalled
        raise TransferError(f"the transfer from {remote.host}:{remote.port} broke: {exc}",
                            "transfer") from None
    return out


def _handshake(sock: socket.socket, remote: Remote, layout: KVLayout, engine_id: str
               ) -> list[int]:
    """The peer's rank ports, once its layout matches ours."""
    send_message(sock, {"op": "hello", "engine_id": engine_id, "layout": layout.to_json()})
    reply = recv_message(sock)
    # said from this side ("... there, ... here"), whichever side found it
    why = layout_mismatch(layout, reply.get("layout") or {}) or \
        (reply.get("error") if not reply.get("ok") else None)
    if why:
        raise TransferError(f"KV transfer refused at handshake with the prefill engine "
                            f"{reply.get('engine_id', remote.engine_id)} at {remote.host}:"
                            f"{remote.port}: {why}", "handshake")
    return [int(p) for p in reply.get("rank_ports") or [remote.port]]


def confirm_only(remote: Remote, request_id: str, timeout_s: float) -> None:
    """Tell the prefill engine its blocks are not needed (best effort: its timeout frees them
    otherwise)."""
    try:
        with socket.create_connection((remote.host, remote.port), timeout=timeout_s) as sock:
            send_message(sock, {"op": "done", "request_id": request_id})
            recv_message(sock)
    except (OSError, TransferError):
        pass

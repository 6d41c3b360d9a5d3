"""The decode side of KVServeConnector: `fetch_blocks` pulls a request's blocks from the prefill
engine's `BlockServer` (handshake, then one frame per layer straight into a host buffer, or, on
the same host, layer by layer out of a shared-memory segment the producer fills; then the
confirmation that lets the prefill side free them). Runs on a thread of the scheduler side, so the
engine keeps stepping while a transfer is on the wire."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.engine.kv_transfer.shm import MappingCache, SegmentRef, host_id
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
                 engine_id: str, timeout_s: float, transports: tuple[str, ...] = ("tcp",),
                 stats: dict[str, int] | None = None, mappings: MappingCache | None = None
                 ) -> list[torch.Tensor]:
    """Every tensor-parallel rank's bytes of `block_ids` (rank 0's server names the others'
    ports at the handshake), then the confirmation to rank 0; TransferError as fetch_blocks."""
    ports: list[int] = []
    first = fetch_blocks(remote, request_id, block_ids, layout, engine_id, timeout_s,
                         confirm=remote.tp_size == 1, rank_ports=ports, transports=transports,
                         stats=stats, mappings=mappings)
    shards = [first]
    for rank in range(1, remote.tp_size):
        if len(ports) != remote.tp_size:
            raise TransferError(f"the prefill engine {remote.engine_id} named {len(ports)} "
                                f"rank ports for tp_size {remote.tp_size}", "handshake")
        shard = Remote(remote.engine_id, remote.host, ports[rank], remote.block_ids,
                       remote.tp_size)
        shards.append(fetch_blocks(shard, request_id, block_ids, layout, engine_id, timeout_s,
                                   confirm=False, transports=transports, stats=stats,
                                   mappings=mappings))
    if remote.tp_size > 1:
        confirm_only(remote, request_id, timeout_s)
    return shards


def fetch_blocks(remote: Remote, request_id: str, block_ids: list[int], layout: KVLayout,
                 engine_id: str, timeout_s: float, confirm: bool = True,
                 rank_ports: list[int] | None = None, transports: tuple[str, ...] = ("tcp",),
                 stats: dict[str, int] | None = None, mappings: MappingCache | None = None
                 ) -> torch.Tensor:
    """The bytes of `block_ids` as `[layers, 2, n, block_size, kv_heads, head_dim x element
    size]` uint8 (one rank's); TransferError when the peer is gone, refuses, or stops
    mid-transfer. `confirm`: tell the peer it may free them; `rank_ports` gets the ports of
    every rank's server, as the handshake names them; `transports`: what this side accepts
    (shm is taken when both sides accept it and run on one host); `stats` gets the bytes
    moved per transport; `mappings`: where this process keeps producers' segments mapped."""
    try:
        sock = socket.create_connection((remote.host, remote.port), timeout=timeout_s)
    except OSError as exc:
        raise TransferError(f"cannot reach the prefill engine {remote.engine_id} at "
                            f"{remote.host}:{remote.port}: {exc}", "connect") from None
    try:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _handshake(sock, remote, layout, engine_id)
            if rank_ports is not None:
                rank_ports[:] = [int(p) for p in hello.get("rank_ports") or [remote.port]]
            transport = choose_transport(transports, hello, remote)
            send_message(sock, {"op": "read", "request_id": request_id, "block_ids": block_ids,
                                "transport": transport})
            reply = recv_message(sock)
            if not reply.get("ok"):
                raise TransferError(f"the prefill engine {remote.engine_id} refused the read: "
                                    f"{reply.get('error')}", "refused")
            per_block = layout.layer_bytes_per_block // 2  # K or V of one block, in bytes
            shape = (layout.num_layers, 2, len(block_ids), per_block)
            if transport == "shm":
                out, transport = _read_shm(sock, reply, shape, "tcp" in transports,
                                           mappings if mappings is not None else MappingCache())
            else:
                out = _read_frames(sock, shape)
            if stats is not None:
                stats[transport] = stats.get(transport, 0) + out.numel()
            if confirm:
                send_message(sock, {"op": "done", "request_id": request_id})
                recv_message(sock)
    except (OSError, ValueError) as exc:  # a timeout or a reset: the peer died or stalled
        raise TransferError(f"the transfer from {remote.host}:{remote.port} broke: {exc}",
                            "transfer") from None
    return out


def choose_transport(mine: tuple[str, ...], hello: dict[str, Any], remote: Remote) -> str:
    """shm when both sides accept it and the peer runs on this host, else tcp when both accept
    it; TransferError (reason "transport") when they share none."""
    theirs = hello.get("transports") or ["tcp"]  # a peer that names none serves frames
    if "shm" in mine and "shm" in theirs and hello.get("host_id") == host_id():
        return "shm"
    if "tcp" in mine and "tcp" in theirs:
        return "tcp"
    raise TransferError(f"no common KV transport with the prefill engine {remote.engine_id} at "
                        f"{remote.host}:{remote.port}: it serves {list(theirs)}, this side takes "
                        f"{list(mine)} (shm needs both on one host; kv_connector_extra_config."
                        "transport)", "transport")


def _read_frames(sock: socket.socket, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.uint8)
    for layer in range(shape[0]):
        recv_frame_into(sock, memoryview(out[layer].numpy()).cast("B"))
    return out


def _read_shm(sock: socket.socket, reply: dict[str, Any], shape: tuple[int, ...], tcp_ok: bool,
              mappings: MappingCache) -> tuple[torch.Tensor, str]:
    """Map the producer's segment (or ask for TCP frames where it cannot be mapped here) and
    copy each layer out as it is named (the producer reuses the segment once told so); the
    bytes and the transport used."""
    out = torch.empty(shape, dtype=torch.uint8)
    try:
        ref = SegmentRef.from_json(reply.get("segment"))
        src = mappings.tensor(ref, out.numel()).view(shape)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        send_message(sock, {"op": "mapped", "ok": False, "tcp": tcp_ok})
        if not tcp_ok:
            raise TransferError(f"cannot map the prefill engine's shared-memory segment "
                                f"({exc}); this side takes shm only", "transport") from None
        return _read_frames(sock, shape), "tcp"
    try:
        send_message(sock, {"op": "mapped", "ok": True})
        for layer in range(shape[0]):
            msg = recv_message(sock)
            if msg.get("layer") != layer:
                raise TransferError(f"layer {msg.get('layer')!r} named, {layer} expected",
                                    "transfer")
            out[layer].copy_(src[layer])
        send_message(sock, {"op": "copied"})
    except BaseException:
        del src
        mappings.drop(ref)  # a producer that broke off keeps no memory mapped here
        raise
    return out, "shm"


def _handshake(sock: socket.socket, remote: Remote, layout: KVLayout, engine_id: str
               ) -> dict[str, Any]:
    """The peer's hello (its rank ports, host and transports), once its layout matches ours."""
    send_message(sock, {"op": "hello", "engine_id": engine_id, "layout": layout.to_json()})
    reply = recv_message(sock)
    # said from this side ("... there, ... here"), whichever side found it
    why = layout_mismatch(layout, reply.get("layout") or {}) or \
        (reply.get("error") if not reply.get("ok") else None)
    if why:
        raise TransferError(f"KV transfer refused at handshake with the prefill engine "
                            f"{reply.get('engine_id', remote.engine_id)} at {remote.host}:"
                            f"{remote.port}: {why}", "handshake")
    return reply


def confirm_only(remote: Remote, request_id: str, timeout_s: float) -> None:
    """Tell the prefill engine its blocks are not needed (best effort: its timeout frees them
    otherwise)."""
    try:
        with socket.create_connection((remote.host, remote.port), timeout=timeout_s) as sock:
            send_message(sock, {"op": "done", "request_id": request_id})
            recv_message(sock)
    except (OSError, TransferError):
        pass

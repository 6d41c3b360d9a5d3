"""A consumer of vLLM's KV events written from vLLM's own definition (vllm/distributed/kv_events.py:
msgspec Structs with omit_defaults and tag=True, so maps with the class name in "type" and fields
in declaration order), with plain msgpack and zmq, and none of kvserve's classes."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

# Declaration order; (required fields, fields with a default that msgspec leaves out when unset).
SCHEMA = {
    "BlockStored": (["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name"],
                    ["extra_keys", "group_idx", "kv_cache_spec_kind",
                     "kv_cache_spec_sliding_window"]),
    "BlockRemoved": (["block_hashes", "medium"], ["group_idx"]),
    "AllBlocksCleared": ([], []),
}
BATCH = (["ts", "events"], ["data_parallel_rank"])
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _check_order(obj: dict[str, Any], required: list[str], optional: list[str],
                 skip: int = 0) -> None:
    keys = list(obj)[skip:]
    assert keys[:len(required)] == required, f"fields {keys}, want {required} first"
    assert all(k in optional for k in keys[len(required):]), f"unknown fields in {keys}"
    declared = required + optional
    assert keys == sorted(keys, key=declared.index), f"fields out of order: {keys}"


def decode_batch(payload: bytes) -> dict[str, Any]:
    """The KVEventBatch in `payload`, its shape checked against vLLM's Structs."""
    batch = msgpack.unpackb(payload, raw=False)
    _check_order(batch, *BATCH)
    for event in batch["events"]:
        assert list(event)[0] == "type" and event["type"] in SCHEMA, event
        _check_order(event, *SCHEMA[event["type"]], skip=1)
        for h in event.get("block_hashes", []):
            assert isinstance(h, (bytes, int)), h  # vLLM's ExternalBlockHash: bytes | int
    return batch


def subscribe(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def receive(sub: zmq.Socket, timeout_ms: int) -> tuple[bytes, int, bytes] | None:
    """One [topic, sequence, payload] message, or None when none came in time."""
    if not sub.poll(timeout_ms):
        return None
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def replay(endpoint: str, start: int, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
    """(sequence, payload) of every buffered batch from `start`, as the replay socket sends
    them before its end marker (a DEALER sends the empty delimiter a REQ socket would)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(timeout_ms), "no answer from the replay socket"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)

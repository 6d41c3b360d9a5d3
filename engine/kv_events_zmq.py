"""KV events in vLLM's wire format over ZMQ, for external schedulers (llm-d / GIE EPPs): vLLM's
KVEventsConfig, the msgpack encoding of KVEventBatch, and a PUB + replay ROUTER publisher that
runs on its own thread, fed by an engine observer that never blocks the step."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.errors import ConfigError

logger = logging.getLogger(__name__)

# Our tiers by vLLM's `medium` names (vLLM's GPU block pool says "GPU", its CPU offload "CPU").
MEDIUMS = {"device": "GPU", "host": "CPU", "disk": "DISK"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-batches marker


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field (`--kv-events-config` JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"  # a `*` (or ipc/inproc) binds, anything else connects
    replay_endpoint: str | None = None  # a ROUTER socket replaying buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"kv_events_config publisher must be 'zmq' or 'null', got "
                              f"{self.publisher!r}")
        if self.buffer_steps < 1 or self.max_queue_size < 1 or self.hwm < 0:
            raise ConfigError("kv_events_config: buffer_steps and max_queue_size must be >= 1, "
                              "hwm >= 0")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """A KVEventsConfig from JSON text, a dict, vLLM's own config object or ours (None: none)."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv_events_config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        value = {f.name: getattr(value, f.name) for f in fields(KVEventsConfig)
                 if hasattr(value, f.name)}
    unknown = sorted(set(value) - {f.name for f in fields(KVEventsConfig)})
    if unknown:
        raise ConfigError(f"kv_events_config: unknown field(s) {unknown}; known: "
                          f"{[f.name for f in fields(KVEventsConfig)]}")
    return KVEventsConfig(**value)


# ---- the wire format ----------------------------------------------------------------------------
def encode_batch(ts: float, events: list[KVEvent], block_size: int,
                 data_parallel_rank: int = 0) -> dict[str, Any] | None:
    """A KVEventBatch as current vLLM's msgspec writes it (maps, each event's class name in
    "type", fields in declaration order, defaults left out); None when nothing changed."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e.kind == "cleared":
            if not out or out[-1]["type"] != "AllBlocksCleared":  # tiers reset together
                out.append({"type": "AllBlocksCleared"})
        elif e.kind == "removed":
            out.append({"type": "BlockRemoved", "block_hashes": _hashes(e.block_hashes),
                        "medium": MEDIUMS[e.medium]})
        else:
            out += [_stored(chain, parent, tokens, block_size, MEDIUMS[e.medium])
                    for chain, parent, tokens in chains(e)]
    if not out:
        return None
    return {"ts": ts, "events": out, "data_parallel_rank": data_parallel_rank}


def chains(event: KVEvent) -> list[tuple[list[str], str | None, list[int]]]:
    """A "stored" event's blocks cut into chains (hashes, parent of the first, all tokens):
    vLLM's BlockStored holds blocks that each extend the previous one."""
    lineage = {h: (parent, tokens) for h, parent, tokens in event.lineage}
    out: list[tuple[list[str], str | None, list[int]]] = []
    for h in event.block_hashes:
        parent, tokens = lineage.get(h, (None, ()))
        last = out[-1] if out else None
        if last is not None and _extends(last, h, parent, lineage):
            last[0].append(h)
            last[2].extend(tokens)
        else:
            out.append(([h], parent, list(tokens)))
    return out


def _extends(chain: tuple[list[str], str | None, list[int]], h: str, parent: str | None,
             lineage: dict[str, Any]) -> bool:
    # A block stored without lineage (the host tier's) travels alone: nothing says it extends
    # the block before it.
    return h in lineage and parent is not None and parent == chain[0][-1]


def _stored(hashes: list[str], parent: str | None, tokens: list[int], block_size: int,
            medium: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": _hashes(hashes),
            "parent_block_hash": bytes.fromhex(parent) if parent is not None else None,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None}


def _hashes(hex_hashes: tuple[str, ...] | list[str]) -> list[bytes]:
    # vLLM's ExternalBlockHash is the hash's raw bytes by default: ours are 16 (blake2b-128).
    return [bytes.fromhex(h) for h in hex_hashes]


# ---- the publisher ------------------------------------------------------------------------------
class ZmqKVEventPublisher:
    """PUB socket sending [topic, 8-byte big-endian sequence, msgpack KVEventBatch] per batch,
    and (with replay_endpoint) a ROUTER answering a start sequence with the buffered batches
    from there, then [END_SEQ, b""]. Sockets are bound here (so a taken port fails at start)
    and used only by the publisher thread afterwards."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        import zmq

        self.block_size = block_size
        self.num_dropped = 0  # batches refused because the queue was full
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        # A batch no subscriber took is dropped at close: the shared context's term() (and so a
        # server's exit) never waits for a subscriber that is gone.
        self._pub.linger = 0
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)  # vLLM's rule: bind a wildcard, connect to a host
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (any thread; never blocks: a full queue drops the batch)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning("KV events: the publisher queue is full; dropping batches")

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets; idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5.0)
        self._pub.close(linger=0)  # closing a closed socket does nothing
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import msgpack

        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            batch = encode_batch(item[0], item[1], self.block_size)
            if batch is None:
                continue
            payload = msgpack.packb(batch, use_bin_type=True)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - a send error must not end the thread
                logger.exception("KV events: publishing batch %d failed", seq)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [identity, empty delimiter (a REQ/DEALER's), start sequence]
            logger.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


@dataclass
class KVEventsObserver:
    """The engine observer feeding the publisher after every step (engine or output thread)."""

    publisher: ZmqKVEventPublisher

    def request_added(self, request_id: str, arrival: float) -> None:
        pass

    def request_aborted(self, request_id: str) -> None:
        pass

    def after_step(self, outputs: list[Any], stats: Any, events: list[KVEvent],
                   engine: Any) -> None:
        self.publisher.publish(events)

    def close(self) -> None:
        self.publisher.close()


def make_kv_events_observer(config: Any) -> KVEventsObserver | None:
    """The observer publishing an EngineConfig's kv_events_config (None when it asks none)."""
    events_config = parse_kv_events_config(getattr(config, "kv_events_config", None))
    if events_config is None or not events_config.publishes:
        return None
    logger.info("KV events: publishing vLLM-format batches on %s%s", events_config.endpoint,
                f" (replay on {events_config.replay_endpoint})"
                if events_config.replay_endpoint else "")
    return KVEventsObserver(ZmqKVEventPublisher(events_config, config.block_size))

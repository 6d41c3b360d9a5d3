"""KVEvent: a batch of prefix-cache changes (blocks stored or removed) for the Redis index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class KVEvent:
    kind: Literal["stored", "removed", "cleared"]  # "cleared": the whole prefix cache was reset
    block_hashes: tuple[str, ...] = ()
    # Which tier changed: "device" (the block pool), "host" or "disk" (the offloading tiers), as
    # vLLM's KV events' `medium`; a router can weigh a host hit below a device hit.
    medium: Literal["device", "host", "disk"] = "device"

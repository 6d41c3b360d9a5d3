"""KVEvent: a batch of prefix-cache changes (blocks stored or removed) for the Redis index and the
ZMQ publisher; KVEventLog: one tier's log of them until drained (block pool, host, disk)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["stored", "removed", "cleared"]
Medium = Literal["device", "host", "disk"]


@dataclass(frozen=True)
class KVEvent:
    kind: Kind  # "cleared": the whole prefix cache was reset
    block_hashes: tuple[str, ...] = ()
    # Which tier changed: "device" (the block pool), "host" or "disk" (the offloading tiers), as
    # vLLM's KV events' `medium`; a router can weigh a host hit below a device hit.
    medium: Medium = "device"
    # "stored" only: (hash, parent hash or None for a prompt's first block, token ids) of the
    # blocks stored with them, which vLLM's BlockStored carries so an external index can rebuild
    # the chain; () when none was. Keyed by hash, not by position, so an event whose
    # block_hashes are filtered (`dataclasses.replace`) stays right.
    lineage: tuple[tuple[str, str | None, tuple[int, ...]], ...] = ()


# (kind, hex hash, hex parent or None, token ids): one change as the log keeps it.
_Entry = tuple[str, str, "str | None", tuple[int, ...]]
_CLEARED: _Entry = ("cleared", "", None, ())


class KVEventLog:
    """Ordered changes of one tier since the last `drain()`, consecutive ones of a kind batched.

    An undrained backlog (offline use never drains) is compacted into "cleared" + one "stored"
    per block `held()` names, which replays to the same state, so memory stays bounded by
    `2 * capacity + 1024` entries.
    """

    def __init__(self, medium: Medium, capacity: int,
                 held: Callable[[], Iterable[bytes]]) -> None:
        self.medium = medium
        self._limit = 2 * capacity + 1024
        self._held = held
        self._entries: list[_Entry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def stored(self, block_hash: bytes, parent: bytes | None = None,
               token_ids: Sequence[int] = ()) -> None:
        self._append(("stored", block_hash.hex(), parent.hex() if parent is not None else None,
                      tuple(token_ids)))

    def removed(self, block_hash: bytes) -> None:
        self._append(("removed", block_hash.hex(), None, ()))

    def cleared(self) -> None:
        """The tier forgot everything: what came before no longer matters."""
        self._entries = [_CLEARED]

    def _append(self, entry: _Entry) -> None:
        self._entries.append(entry)
        if len(self._entries) > self._limit:
            self._entries = [_CLEARED] + [("stored", h.hex(), None, ()) for h in self._held()]

    def drain(self) -> list[KVEvent]:
        """The changes since the last call, in order, as KVEvents tagged with this medium."""
        events: list[KVEvent] = []
        run: list[_Entry] = []
        for entry in self._entries:
            if run and entry[0] != run[0][0] or entry[0] == "cleared":
                events += self._batch(run)
                run = []
            run.append(entry)
        events += self._batch(run)
        self._entries = []
        return events

    def _batch(self, run: list[_Entry]) -> list[KVEvent]:
        if not run:
            return []
        kind = run[0][0]
        if kind == "cleared":
            return [KVEvent("cleared", medium=self.medium)]
        hashes = tuple(e[1] for e in run)
        lineage = tuple(e[1:] for e in run if e[2] is not None or e[3])
        return [KVEvent(kind, hashes, self.medium, lineage)]  # type: ignore[arg-type]

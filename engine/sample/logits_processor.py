"""vLLM v1's custom logits processors: the `LogitsProcessor` / `BatchUpdate` contract,
`AdapterLogitsProcessor` (per-request processors wrapped into a batch-level one), and the
persistent batch slots that tell each processor which requests joined, left or moved."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial
from enum import Enum
from typing import Any

import torch


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = 0  # a's state moves to b; a is empty after
    SWAP = 1


@dataclass
class BatchUpdate:
    """What changed in the batch since the last step, applied in this order: added (index,
    SamplingParams, prompt token ids, output token ids: a live list), removed, moved."""

    batch_size: int
    removed: Seq[int] = field(default_factory=list)
    moved: Seq[tuple[int, int, MoveDirectionality]] = field(default_factory=list)
    added: Seq[tuple[int, Any, list[int], list[int]]] = field(default_factory=list)


class LogitsProcessor:
    """vLLM's base: one instance per engine, applied to the whole batch's logits each step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def process_dict_updates(entries: dict[int, Any], batch_update: BatchUpdate | None,
                         new_state: Callable[[Any, list[int], list[int]], Any]) -> bool:
    """vLLM's helper for a processor keeping per-row state in a dict (batch index -> state):
    applies a BatchUpdate (added rows get `new_state(params, prompt ids, output ids)`, None for
    rows it does not apply to; removed rows are dropped; moved rows follow); True if it changed."""
    if not batch_update:
        return False
    changed = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            entries[index] = state
            changed = True
        elif entries.pop(index, None) is not None:
            changed = True
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        a_state, b_state = entries.pop(a, None), entries.pop(b, None)
        if a_state is not None:
            entries[b] = a_state
        if b_state is not None and direction == MoveDirectionality.SWAP:
            entries[a] = b_state
        changed |= a_state is not None or b_state is not None
    return changed


# vLLM's per-request processor: (output ids, logits row) -> logits row, or with the prompt ids
# first: (prompt ids, output ids, logits row) -> logits row. The id lists are live.
RequestLogitsProcessor = (Callable[[list[int], torch.Tensor], torch.Tensor]
                          | Callable[[list[int], list[int], torch.Tensor], torch.Tensor])


class AdapterLogitsProcessor(LogitsProcessor):
    """vLLM's wrapper of request-level processors into a batch-level one: a subclass makes each
    request's processor from its SamplingParams (`new_req_logits_processor`, None to leave that
    request alone), and each step every such row's logits go through its processor."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    def new_req_logits_processor(self, params: Any) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(self, params: Any, prompt_ids: list[int], output_ids: list[int]
                   ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        proc = self.new_req_logits_processor(params)
        if proc is None:
            return None
        if len(inspect.signature(proc).parameters) == 3:
            return partial(proc, prompt_ids, output_ids)
        return partial(proc, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, proc in self.req_info.items():
            logits[index] = proc(logits[index])  # in place or a new row: either is kept
        return logits


class LogitsProcessors:
    """The engine's processors over a dense, persistent slot order (vLLM's persistent batch): a
    new row takes a freed slot or is appended; holes are filled by moving the last slot down."""

    def __init__(self, classes: Seq[type], config: Any, device: torch.device) -> None:
        self.procs = [cls(config, device, False) for cls in classes]
        self.slots: list[Any] = []  # slot -> row key

    def apply(self, logits: torch.Tensor, keys: list[Any], rows: list[Any]) -> torch.Tensor:
        """`keys[i]` names logits row i (stable across steps), `rows[i]` its Sequence."""
        update = self._update(keys, rows)
        for proc in self.procs:
            proc.update_state(update)
        where = {k: i for i, k in enumerate(keys)}
        perm = torch.tensor([where[k] for k in self.slots], device=logits.device)
        slotted = logits[perm]
        for proc in self.procs:
            slotted = proc.apply(slotted)
        out = torch.empty_like(logits)
        out[perm] = slotted
        return out

    def _update(self, keys: list[Any], rows: list[Any]) -> BatchUpdate | None:
        live = set(keys)
        free = [i for i, k in enumerate(self.slots) if k not in live]
        known = set(self.slots)
        added = []
        for key, seq in zip(keys, rows):
            if key in known:
                continue
            index = free.pop(0) if free else len(self.slots)
            if index == len(self.slots):
                self.slots.append(key)
            else:
                self.slots[index] = key
            added.append((index, seq.params, seq.prompt_token_ids, seq.output_token_ids))
        removed, moved = list(free), []
        for hole in sorted(free):
            while self.slots and self.slots[-1] not in live:
                self.slots.pop()
            if hole < len(self.slots):
                moved.append((len(self.slots) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
                self.slots[hole] = self.slots.pop()
        del self.slots[len(keys):]
        if not (added or removed or moved):
            return None
        return BatchUpdate(len(self.slots), removed, moved, added)

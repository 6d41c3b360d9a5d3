"""Micro-batches of one pipeline-parallel step: the step's sequences cut into up to M contiguous
groups of about equal token counts, each a StepInput of its own, so that stage s runs
micro-batch k + 1 while stage s + 1 runs micro-batch k (GPipe's schedule inside a step; vLLM
overlaps whole batches instead, which needs disjoint requests in flight). Every stage cuts the
same step the same way, so no rank decides alone; a sequence is never cut, so each attends
exactly as in the whole step. Only the last stage's hidden states are put back together (in
order), and the logits, prompt logprobs and sampling then run on the whole step as before.

`KVSERVE_PP_MICROBATCHES` (default: the number of stages; 1: off) sets M, read on the driver
(pipeline.microbatches_for) and sent to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.worker.step_input import BlockMoves, StepInput


@dataclass(frozen=True)
class MicroBatch:
    step: StepInput
    lo: int  # its first token in the whole step's flattened batch
    hi: int


def cut_points(query_start_loc: torch.Tensor, parts: int) -> list[int]:
    """Sequence indices [0, ..., B] cutting B sequences into <= `parts` groups of about equal
    token counts (each group at least one sequence)."""
    qsl = query_start_loc.tolist()
    b = len(qsl) - 1
    parts = max(min(parts, b), 1)
    total = qsl[-1]
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        i = cuts[-1] + 1
        while i < b - (parts - k) and qsl[i] < target:
            i += 1
        cuts.append(i)
    cuts.append(b)
    return cuts


def split_step(step: StepInput, parts: int) -> list[MicroBatch]:
    """The step as <= `parts` micro-batches (one when it has a single sequence)."""
    cuts = cut_points(step.query_start_loc, parts)
    if len(cuts) <= 2:
        return [MicroBatch(step, 0, int(step.input_ids.shape[0]))]
    return [_part(step, b0, b1) for b0, b1 in zip(cuts, cuts[1:])]


def _part(step: StepInput, b0: int, b1: int) -> MicroBatch:
    qsl = step.query_start_loc
    lo, hi = int(qsl[b0]), int(qsl[b1])
    q_lens = qsl[b0 + 1:b1 + 1] - qsl[b0:b1]
    seq_lens = step.seq_lens[b0:b1]
    sub = StepInput(step.input_ids[lo:hi], step.positions[lo:hi], step.slot_mapping[:, lo:hi],
                    step.block_tables[:, b0:b1], seq_lens, qsl[b0:b1 + 1] - lo,
                    int(q_lens.max()), int(seq_lens.max()), [], BlockMoves())
    if step.lora_slots is not None:
        sub.lora_slots = step.lora_slots[lo:hi]
    if step.embeds is not None:
        rows, values = step.embeds
        keep = (rows >= lo) & (rows < hi)
        if bool(keep.any()):
            sub.embeds = (rows[keep] - lo, values[keep])
    return MicroBatch(sub, lo, hi)


__all__ = ["MicroBatch", "cut_points", "split_step"]

"""Prompt logprobs (vLLM's `SamplingParams(prompt_logprobs=k)`): for every prompt token after the
first, its logprob given the tokens before it, its rank, and the k most likely tokens there.

The model runner normally applies the LM head to each sequence's last position only. For the
requests that ask prompt logprobs, the engine plans which rows of the step's flattened batch are
prompt positions still owed (`plan`), the runner gathers those hidden states, applies the LM head
to just them and reduces them in batched tensor ops (`compute`), and the engine turns the result
into one list per request (`append_entries`, a loop per request, off the tensor path).

- Prefix caching: a cached block has no hidden states, so a request still owed prompt logprobs
  does not use prefix-cache hits (as vLLM v1); its blocks are still registered for others.
- Chunked prefill: each chunk adds its positions; the list is complete with the last chunk.
- Preemption by recompute: positions already recorded are not asked again (no duplicates).
- n > 1 / best_of: the prompt is prefilled once, by the parent, before its siblings fork.
- Tensor parallelism: the LM head is vocabulary-sharded, so every rank runs `compute` on the same
  rows (the logits are gathered to rank 0, which alone reduces them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.outputs import Logprob

# Prompt rows sent through the LM head at once: bounds the [rows, vocab] float32 logits (a
# 2,048-token chunk of a 128k vocabulary would be 1 GiB at once).
ROWS_PER_PASS = 256


@dataclass
class PromptLogprobsPlan:
    """Which rows of one step's flattened batch give prompt logprobs, and for whom."""

    seqs: list[Sequence]  # the sequences owed entries this step, in batch order
    counts: list[int]  # how many entries each gets
    rows: list[int]  # flattened batch rows (hidden states), concatenated over `seqs`
    targets: list[int]  # the prompt token each row predicts
    k: int  # top-k width: the largest prompt_logprobs of the step


@dataclass
class PromptLogprobsResult:
    """CPU tensors, one row per planned row."""

    token_logprobs: torch.Tensor  # fp32 [R]: the actual next prompt token's logprob
    ranks: torch.Tensor  # int32 [R]: its rank, 1 = the most likely
    top_logprobs: torch.Tensor  # fp32 [R, k]
    top_ids: torch.Tensor  # int64 [R, k]


def plan(seqs: list[Sequence], num_tokens: list[int]) -> PromptLogprobsPlan | None:
    """The rows of the scheduled chunks that are prompt positions not yet recorded.

    Position p's hidden state predicts token p + 1, so a chunk [s, s + n) of a prompt of length
    P owes the entries of positions max(s, recorded) .. min(s + n, P - 1) - 1, where `recorded`
    is the number of positions already done (a recompute after preemption starts over at 0)."""
    out = PromptLogprobsPlan([], [], [], [], 0)
    offset = 0
    for seq, n in zip(seqs, num_tokens):
        if seq.wants_prompt_logprobs:
            s = seq.num_computed_tokens
            first = max(s, len(seq.prompt_logprobs or [None]) - 1)
            last = min(s + n, seq.num_prompt_tokens - 1)
            if last > first:
                out.seqs.append(seq)
                out.counts.append(last - first)
                out.rows += range(offset + first - s, offset + last - s)
                out.targets += seq.prompt_token_ids[first + 1 : last + 1]
                out.k = max(out.k, seq.params.prompt_logprobs or 0)
        offset += n
    return out if out.seqs else None


@torch.inference_mode()
def compute(model: Any, hidden: torch.Tensor, rows: list[int], targets: list[int],
            k: int) -> PromptLogprobsResult | None:
    """LM head on the planned rows, log_softmax, then the target's logprob and rank and the
    top-k, a slice of ROWS_PER_PASS rows at a time. Every tensor-parallel rank calls it (the
    logits gather is a collective); rank 0 gets the result, the others None."""
    dev = hidden.device
    row_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    target_t = torch.tensor(targets, dtype=torch.int64, device=dev)
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, len(rows), ROWS_PER_PASS):
        sl = slice(start, start + ROWS_PER_PASS)
        logits = model.compute_logits(hidden[row_t[sl]])
        if logits is None:  # a tensor-parallel rank other than 0
            continue
        lp = logits.float().log_softmax(dim=-1)  # faster than logsumexp on the CPU
        own = lp.gather(1, target_t[sl].unsqueeze(1))
        # as vLLM's: 1 = the most likely, ties count ahead (an int32 sum: a third faster)
        ranks = (lp >= own).sum(dim=-1, dtype=torch.int32)
        if k:
            top, top_ids = lp.topk(k, dim=-1)
        else:  # the actual token only: empty top-k columns
            top, top_ids = lp[:, :0], torch.empty((lp.shape[0], 0), dtype=torch.int64, device=dev)
        parts.append((own.squeeze(1), ranks, top, top_ids))
    if not parts:
        return None
    own, ranks, top_lp, top_ids = (torch.cat(p).cpu() for p in zip(*parts))
    return PromptLogprobsResult(own, ranks, top_lp, top_ids)


def append_entries(p: PromptLogprobsPlan, result: PromptLogprobsResult, tokenizer: Any) -> None:
    """Turn the step's result into Logprob dicts on each planned sequence (the actual token
    first, then the top-k, as vLLM's); one batched decode of every token id involved."""
    own = result.token_logprobs.tolist()
    ranks = result.ranks.tolist()
    top_lp = result.top_logprobs.tolist()
    top_ids = result.top_ids.tolist()
    ids = sorted(set(p.targets).union(*map(set, top_ids)) if top_ids else set(p.targets))
    text = dict(zip(ids, tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)))
    start = 0
    for seq, count in zip(p.seqs, p.counts):
        k = seq.params.prompt_logprobs or 0
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        for r in range(start, start + count):
            tok = p.targets[r]
            entry = {tok: Logprob(own[r], ranks[r], text[tok])}
            for rank, (tid, value) in enumerate(zip(top_ids[r][:k], top_lp[r][:k]), 1):
                entry.setdefault(tid, Logprob(value, rank, text[tid]))
            seq.prompt_logprobs.append(entry)
        start += count

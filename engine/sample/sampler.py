"""Sampler: one step's logits -> next tokens and raw logprobs, vectorised over the batch.

Order (as vLLM v1): the grammar bitmask of constrained rows; raw logprobs = log_softmax(those
logits); logit_bias; min_tokens masking; penalties
(repetition over prompt+output, presence/frequency over output); greedy rows take the argmax;
random rows are divided by their temperature, filtered by min_p, top_k, top_p and drawn by inverse
CDF with one uniform per row (engine/sample/random_draw.py): a seeded row's uniform is a hash of
(seed, sample index, output position), so its tokens depend neither on the rest of the batch nor
on what ran before on this engine; other rows draw from torch's global generator.

`python bench/sampler.py` times each setting against a full sort of every row (vLLM's top-p);
its figures are in docs/perf.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.engine.sample.random_draw import inverse_cdf, row_uniform, row_uniforms
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.structured_output.grammar import apply_token_bitmask
from kvserve.kernels import checks
from kvserve.kernels.cpu_ops import argmax

# Below this temperature a row is greedy (the same threshold as SamplingParams.greedy).
GREEDY_EPS = 1e-5
# top-k / top-p are solved on this many largest logits per row before falling back to a full sort.
TOP_P_CANDIDATES = 1024


@dataclass
class SamplingMetadata:
    """Per-step sampling settings of the S rows being sampled: device tensors + fast-path flags.

    Build it with `SamplingMetadata.build`. When constructing it by hand, the optional fields at the
    end may stay at their defaults: they only enable fast paths. `prompt_token_ids = None` means no
    prompt tokens count for the repetition penalty (build leaves it None when no row has one).
    """

    temperature: torch.Tensor  # fp32 [S]; < GREEDY_EPS means greedy
    top_p: torch.Tensor  # fp32 [S]
    top_k: torch.Tensor  # int64 [S]; >= vocab size = off
    min_p: torch.Tensor  # fp32 [S]
    presence_penalty: torch.Tensor  # fp32 [S]
    frequency_penalty: torch.Tensor  # fp32 [S]
    repetition_penalty: torch.Tensor  # fp32 [S]
    prompt_token_ids: list[list[int]] | None
    output_token_ids: list[list[int]] | None
    # (rows, float64 uniforms) of the seeded random rows (random_draw.row_uniform), rows ascending
    seeded: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None  # None = no logprobs this step
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_p_top_k_min_p: bool
    # Optional fast-path hints (False / None = "unknown, look at the tensors").
    no_top_p: bool = False
    no_min_p: bool = False
    no_top_k: bool = False
    # (rows, token ids) whose logits are -inf this step: stop/EOS tokens of rows under min_tokens.
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)
    # (rows, int32 bitmask [S, ceil(V/32)]) of the rows under a grammar (structured_output/):
    # forbidden tokens are -inf before anything else, so logprobs see the constrained distribution.
    token_bitmask: tuple[list[int], torch.Tensor] | None = field(default=None)
    # (rows, token ids, biases) added to the logits after the raw logprobs (OpenAI's logit_bias).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        sample_indices: dict[int, int],
        vocab_size: int,
        device: torch.device | str,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> SamplingMetadata:
        """Metadata for rows `params[i]`; the EOS id(s) are blocked under min_tokens.
        `sample_indices`: row -> which of its request's samples it draws for (n > 1, a
        continuation's choice; absent: 0); a seeded row's position is its output's length."""
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError(
                f"build() needs one prompt and one output list per row: got {len(params)} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs."
            )
        greedy = [p.temperature < GREEDY_EPS for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        floats = torch.tensor(
            [[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
              p.repetition_penalty] for p in params],
            dtype=torch.float32,
        ).reshape(len(params), 6).t().contiguous().to(device)
        temperature, top_p, min_p, presence, frequency, repetition = floats.unbind(0)
        flags = _fast_path_flags(params, greedy, top_k, vocab_size)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature, top_p=top_p,
            top_k=torch.tensor(top_k, dtype=torch.int64).to(device),
            min_p=min_p, presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition,
            prompt_token_ids=None if flags.pop("no_repetition") else prompt_token_ids,
            output_token_ids=None if flags["no_penalties"] else output_token_ids,
            seeded=_seeded_uniforms(params, greedy, output_token_ids, sample_indices, device),
            max_num_logprobs=max(wanted) if wanted else None,
            all_greedy=all(greedy), all_random=not any(greedy),
            min_tokens_block=_min_tokens_block(
                params, output_token_ids, eos_token_id, vocab_size, device
            ),
            logit_bias=_logit_bias(params, vocab_size, device),
            **flags,
        )


def _fast_path_flags(
    params: list[SamplingParams], greedy: list[bool], top_k: list[int], vocab_size: int
) -> dict[str, bool]:
    """Which stages no row needs; filters of greedy rows do not count (they take the argmax)."""
    random_rows = [(p, k) for p, k, g in zip(params, top_k, greedy) if not g]
    no_top_p = all(p.top_p >= 1.0 for p, _ in random_rows)
    no_min_p = all(p.min_p <= 0.0 for p, _ in random_rows)
    no_top_k = all(k >= vocab_size for _, k in random_rows)
    no_repetition = all(p.repetition_penalty == 1.0 for p in params)
    no_penalties = no_repetition and all(
        p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params
    )
    return dict(
        no_penalties=no_penalties, no_repetition=no_repetition,
        no_top_p_top_k_min_p=no_top_p and no_min_p and no_top_k,
        no_top_p=no_top_p, no_min_p=no_min_p, no_top_k=no_top_k,
    )


def _seeded_uniforms(
    params: list[SamplingParams], greedy: list[bool], output_token_ids: list[list[int]],
    sample_indices: dict[int, int], device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, uniforms) of the seeded random rows: keyed by (seed, sample index, position)."""
    rows = [r for r, (p, g) in enumerate(zip(params, greedy)) if p.seed is not None and not g]
    if not rows:
        return None
    values = [row_uniform(params[r].seed, sample_indices.get(r, 0), len(output_token_ids[r]))
              for r in rows]  # type: ignore[arg-type]
    return (torch.tensor(rows, dtype=torch.int64).to(device),
            torch.tensor(values, dtype=torch.float64).to(device))


def _min_tokens_block(
    params: list[SamplingParams], output_token_ids: list[list[int]],
    eos_token_id: int | Sequence[int] | None, vocab_size: int, device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, tokens) to forbid: stop tokens (+ EOS unless ignore_eos) of rows under min_tokens."""
    if eos_token_id is None:
        eos: list[int] = []
    else:
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    rows: list[int] = []
    tokens: list[int] = []
    for row, (p, out) in enumerate(zip(params, output_token_ids)):
        if len(out) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stops.update(eos)
        for tok in sorted(t for t in stops if 0 <= t < vocab_size):
            rows.append(row)
            tokens.append(tok)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64).to(device),
            torch.tensor(tokens, dtype=torch.int64).to(device))


def _logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, tokens, biases) of the rows that carry a logit_bias; ids past the vocabulary are
    refused when the request is added, and skipped here."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        for tok, value in (p.logit_bias or {}).items():
            if 0 <= tok < vocab_size:
                rows.append(row)
                tokens.append(tok)
                values.append(float(value))
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64).to(device),
            torch.tensor(tokens, dtype=torch.int64).to(device),
            torch.tensor(values, dtype=torch.float32).to(device))


@dataclass
class SamplerOutput:
    """Sampled tokens and, when asked, logprobs of the raw model distribution."""

    sampled_token_ids: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None  # fp32 [S, k+1]: the sampled token's logprob first, then top-k
    logprob_token_ids: torch.Tensor | None  # int64 [S, k+1]
    sampled_token_ranks: torch.Tensor | None = None  # int64 [S]: 1 = the most likely token


@dataclass(frozen=True)
class Sampler:
    """Stateless: every per-request state (seeded draws, token history) comes in the metadata.

    `top_p_candidates`: top-p is solved on this many largest logits per row before a full sort.
    """

    top_p_candidates: int = TOP_P_CANDIDATES

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` ([S, V], any float dtype); `logits` is never
        modified. Every stage but the plain argmax runs on a float32 copy."""
        if meta.token_bitmask is not None:
            logits = apply_token_bitmask(logits, *meta.token_bitmask)
        if meta.all_greedy and meta.max_num_logprobs is None and meta.min_tokens_block is None \
                and meta.no_penalties and meta.logit_bias is None:
            return SamplerOutput(argmax(logits), None, None)  # widening to fp32 keeps the order
        logits = logits.float()
        raw_logprobs = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if meta.logit_bias is not None:
            rows, tokens, values = meta.logit_bias
            logits = logits.index_put((rows, tokens), values, accumulate=True)
        if meta.min_tokens_block is not None:
            blocked = logits.index_put(meta.min_tokens_block, logits.new_full((), float("-inf")))
            if meta.token_bitmask is not None:  # a finished grammar allows only EOS: it wins
                dead = blocked.amax(dim=-1, keepdim=True) == float("-inf")
                blocked = torch.where(dead, logits, blocked)
            logits = blocked
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        if meta.all_greedy:
            sampled = argmax(logits)
        else:
            sampled = _sample_random(logits, meta, self.top_p_candidates)
            if not meta.all_random:
                greedy_rows = meta.temperature < GREEDY_EPS
                sampled = torch.where(greedy_rows, argmax(logits), sampled)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None)
        return gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata, candidates: int) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then the inverse-CDF draw (greedy rows use T=1)."""
    temperature = torch.where(meta.temperature < GREEDY_EPS, 1.0, meta.temperature)
    logits = logits / temperature.unsqueeze(1)  # out of place: the caller's tensor stays intact
    if not meta.no_top_p_top_k_min_p:
        if not meta.no_min_p:
            logits = apply_min_p(logits, meta.min_p)
        top_k = None if meta.no_top_k else meta.top_k
        top_p = None if meta.no_top_p else meta.top_p
        if top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p, candidates)
    return inverse_cdf(logits, row_uniforms(logits.shape[0], meta.seeded, logits.device))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability (in place).

    In logit space, p_i < min_p * p_max is l_i < l_max + log(min_p): no softmax needed.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    candidates: int = TOP_P_CANDIDATES, full_sort: bool | None = None,
) -> torch.Tensor:
    """Mask (in place) logits below each row's top-k / top-p threshold; ties at it are kept.

    top-k keeps the k largest logits; top-p then keeps the smallest prefix of the renormalised,
    descending distribution whose mass reaches p (vLLM's semantics). Instead of sorting the whole
    vocabulary, the costliest step of a sampled batch on the CPU, each row is first solved on its
    `candidates` largest logits; only rows whose kept set may reach past them (a flat
    distribution, or top_k above the candidates) are sorted in full. Which way a row goes depends
    on that row alone, so seeded rows stay independent of the batch. Without top-p, the k-th
    largest logit is exact whatever the width, so the width shrinks to the batch's largest k.

    `full_sort` (default: on a device, not the CPU) sorts every row in full instead: the pre-pass reads the
    width and the unsolved rows back on the host, a sync a GPU's fast sort does not need.
    """
    num_rows, vocab = logits.shape
    k = top_k if top_k is not None else torch.full((num_rows,), vocab, device=logits.device)
    p = top_p if top_p is not None else torch.ones(num_rows, device=logits.device)
    if not checks.host_readable(logits) if full_sort is None else full_sort:
        ordered = logits.sort(dim=-1, descending=True).values
        threshold = _thresholds(ordered, k, p, None, vocab)[0]
        return logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))
    full_lse = None if top_p is None else logits.logsumexp(dim=-1)
    width = min(vocab, candidates)
    if top_p is None:
        width = max(1, int(torch.where(k < vocab, k, 0).max()))
    threshold, solved = _thresholds(logits.topk(width, dim=-1).values, k, p, full_lse, vocab)
    if not bool(solved.all()):
        rows = (~solved).nonzero().squeeze(1)
        ordered = logits[rows].sort(dim=-1, descending=True).values
        threshold[rows] = _thresholds(ordered, k[rows], p[rows], None, vocab)[0]
    return logits.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))


def _thresholds(
    values: torch.Tensor, k: torch.Tensor, p: torch.Tensor, full_lse: torch.Tensor | None,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest kept logit, solved) per row from its `width` largest logits, sorted descending.

    `full_lse` (logsumexp of the whole row) normalises rows without top-k; None = no row uses
    top-p. A row is solved when its kept set provably lies within `values`.
    """
    width = values.shape[1]
    in_k = torch.arange(width, device=values.device) < k.unsqueeze(1)
    values = values.masked_fill(~in_k, float("-inf"))
    keep = in_k
    if full_lse is not None or width == vocab:
        lse = values.logsumexp(dim=-1)
        if full_lse is not None:
            lse = torch.where(k <= width, lse, full_lse)
        # fp64 so that the boundary token is decided within 1e-12, not fp32's ~1e-6 after 1000 adds.
        probs = (values.double() - lse.double().unsqueeze(1)).exp()
        before = torch.zeros_like(probs)  # probability mass strictly before each position
        before[:, 1:] = probs[:, :-1].cumsum(dim=-1)
        keep = keep & ((before < p.unsqueeze(1)) | (p >= 1.0).unsqueeze(1))
    kept = keep.sum(dim=-1)  # >= 1: position 0 always survives
    threshold = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    off = (k >= vocab) & (p >= 1.0)
    threshold = threshold.masked_fill(off, float("-inf"))
    solved = off | (k <= width) | ((k >= vocab) & (kept < width))
    return threshold, solved


def flat_token_index(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """`row * vocab_size + token` for every token of every row: int64, flat, on `device`."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}) (the logits' width); got "
            f"[{int(flat.min())}, {int(flat.max())}]. Is the tokenizer larger than the model?"
        )
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    return (rows * vocab_size + flat).to(device)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM/OpenAI penalties, out of place.

    repetition (r): a token seen in the prompt or the output has its logit divided by r when
    positive, multiplied by r otherwise; then `logit -= frequency * count_in_output`, then
    `logit -= presence` if the token occurs in the output. Only the (row, token) pairs that occur
    are touched: `unique` over flat indices gives them and their counts in one vectorised pass,
    instead of five passes over a dense [S, V] count tensor.
    """
    num_rows, vocab = logits.shape
    outputs = meta.output_token_ids or [[] for _ in range(num_rows)]
    # `unique` on the host, where the token ids are: on a device its output size is a sync.
    out_idx, out_count = flat_token_index(outputs, vocab, "cpu").unique(return_counts=True)
    seen = out_idx
    if meta.prompt_token_ids is not None:
        prompt_idx = flat_token_index(meta.prompt_token_ids, vocab, "cpu")
        seen = torch.cat([prompt_idx, out_idx]).unique()
    dev = logits.device
    out_idx, out_count, seen = (t.to(dev, non_blocking=True) for t in (out_idx, out_count, seen))
    flat = logits.flatten().clone()
    rep = meta.repetition_penalty[seen // vocab]
    seen_logits = flat[seen]
    flat[seen] = torch.where(seen_logits > 0, seen_logits / rep, seen_logits * rep)
    rows = out_idx // vocab
    out_logits = flat[out_idx] - meta.frequency_penalty[rows] * out_count.to(flat.dtype)
    flat[out_idx] = out_logits - meta.presence_penalty[rows]
    return flat.view(num_rows, vocab)


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> SamplerOutput:
    """Sampled token's logprob (and rank) first, then the top-k of the raw distribution."""
    sampled_col = sampled.unsqueeze(1)
    sampled_lp = raw_logprobs.gather(1, sampled_col)
    ranks = (raw_logprobs >= sampled_lp).sum(dim=-1)
    if k > 0:
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
        sampled_lp = torch.cat([sampled_lp, top_lp], dim=1)
        sampled_col = torch.cat([sampled_col, top_ids], dim=1)
    return SamplerOutput(sampled, sampled_lp, sampled_col, ranks)

"""The ngram proposer (vLLM's prompt lookup): find the latest earlier occurrence of the longest
suffix of the request's tokens (prompt and output), between prompt_lookup_min and
prompt_lookup_max tokens long, and propose the tokens that followed it.

Vectorised over the batch: the token lists are right-aligned in one padded [B, L] array; for
each shift i < max_n one comparison `T[:, e - i] == T[:, L - 1 - i]` over every end position e,
and a cumulative product gives every position's match length at once. No per-token loop."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvserve.engine.spec_decode.proposer import Proposer, SpecRequestView
from kvserve.engine.spec_decode.registry import register_proposer

PAD = -1  # left padding of the token array
SUFFIX_PAD = -2  # a suffix position before the request's first token: matches nothing


def match_ends(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """For a right-aligned [B, L] array: per row, the end index e of the latest window (ending
    before the last token) that matches the longest suffix of length in [min_n, max_n], and
    that length (0: no match)."""
    b, length = tokens.shape
    ends = length - 1  # candidate window ends: 0 .. L - 2 (a token must follow the window)
    if ends <= 0:
        return np.zeros(b, np.int64), np.zeros(b, np.int64)
    suffix = tokens[:, length - max_n:][:, ::-1].copy()  # suffix[:, i] = T[:, L - 1 - i]
    suffix[suffix == PAD] = SUFFIX_PAD
    run = np.ones((b, ends), dtype=bool)
    match_len = np.zeros((b, ends), dtype=np.int64)
    for i in range(max_n):  # shift i: T[e - i] against T[L - 1 - i], every e at once
        shifted = np.full((b, ends), SUFFIX_PAD - 1, dtype=tokens.dtype)
        shifted[:, i:] = tokens[:, : ends - i]
        run &= shifted == suffix[:, i : i + 1]
        match_len += run
    match_len[match_len < min_n] = 0
    score = match_len * length + np.arange(ends)  # longest first, then the latest
    best = score.argmax(axis=1)
    return best, match_len[np.arange(b), best]


@register_proposer
class NgramProposer(Proposer):
    method = "ngram"

    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        if not requests or num_tokens <= 0:
            return [[] for _ in requests]
        lo = self.config.prompt_lookup_min
        hi = self.config.prompt_lookup_max
        length = max(len(r.token_ids) for r in requests)
        tokens = np.full((len(requests), length), PAD, dtype=np.int64)
        for row, r in enumerate(requests):  # one copy per request, not per token
            tokens[row, length - len(r.token_ids):] = r.token_ids
        best, found = match_ends(tokens, lo, hi)
        out: list[list[int]] = []
        for row, (e, n) in enumerate(zip(best.tolist(), found.tolist())):
            out.append(tokens[row, e + 1 : e + 1 + num_tokens].tolist() if n else [])
        return out

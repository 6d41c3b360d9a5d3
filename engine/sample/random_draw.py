"""The random draw of sampled rows: inverse CDF with one uniform per row. A seeded row's uniform
is a counter-based hash of (seed, sample index, position), so the token drawn at an output
position depends on nothing else: a continuation on another replica draws what the first one
would have (docs/guides/vllm.md, "Continuations and token ids")."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit words with full avalanche."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def check_seed(seed: int | None) -> None:
    """ValueError for a seed outside the signed 64-bit range SamplingParams allows (one changed
    after the request was accepted): its request fails alone, not the step."""
    if seed is not None and not -(1 << 63) <= seed < (1 << 63):
        raise ValueError(f"Overflow: seed {seed} is outside the signed 64-bit range")


def row_uniform(seed: int, index: int, position: int) -> float:
    """The uniform in [0, 1) of output `position` of sample `index` under `seed` (53 bits,
    the same on every host and device: plain integer arithmetic)."""
    x = _mix64(seed & _MASK64)
    x = _mix64(x ^ (index & _MASK64))
    x = _mix64(x ^ (position & _MASK64))
    return (x >> 11) * 2.0 ** -53


def inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row r's token: the first whose cumulative weight exceeds uniforms[r] x the row's total.

    `logits` (float32 [S, V], masked tokens -inf) is overwritten. The cumulative sum runs in
    float64 so each token keeps its own weight to ~1e-16 of the row's total (float32 would round
    tokens under ~3e-8 of it to 0 or double them); a token of weight 0 is never drawn. One
    uniform a row instead of one per token: ~5x cheaper than the exponential race on the CPU
    (docs/perf/sampling.md).
    """
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    cdf = weights.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so the search never runs past the last token of weight > 0
    x = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def row_uniforms(num_rows: int, seeded: tuple[torch.Tensor, torch.Tensor] | None,
                 device: torch.device) -> torch.Tensor:
    """float64 [num_rows]: `seeded` = (rows, their uniforms); other rows draw from torch's
    global generator (nothing is drawn from it when every row is seeded)."""
    if seeded is not None and seeded[0].numel() == num_rows:
        return seeded[1]  # rows are 0..S-1 in order (build lists them so)
    u = torch.rand(num_rows, dtype=torch.float64, device=device)
    if seeded is not None:
        u[seeded[0]] = seeded[1]
    return u

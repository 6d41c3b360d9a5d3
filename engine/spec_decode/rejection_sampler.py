"""Verification of drafted tokens against the target model, keeping its output distribution.

Two forms, both exact:
- `num_accepted(drafts, sampled)`: the engine's path for deterministic drafts (q one-hot on the
  draft, every proposer here). The target samples token t_j at each scored position j from its
  own processed distribution p_j (the regular sampler: penalties, top-k/p, seeds included), and
  draft d_j is accepted while t_j == d_j; the first t_j that differs is emitted in its place,
  and when every draft is accepted t_k is the bonus token. This IS rejection sampling with a
  one-hot q: P(accept d) = p(d), and on rejection t is distributed as p restricted to t != d,
  renormalised, which is norm(max(p - q, 0)). Greedy rows (argmax) accept exactly the drafts
  non-speculative decoding would have produced, and a seeded row draws each position with the
  uniform non-speculative decoding uses there, so its tokens are the same too.
- `rejection_sample(target_probs, drafts, draft_probs, uniforms)`: the general algorithm of
  Leviathan et al. / Chen et al. for drafts with a proposal distribution q (accept d_j with
  probability min(1, p(d_j) / q(d_j)); on rejection draw from norm(max(p - q, 0)); a bonus draw
  from p_k when all are accepted), for draft models that sample their drafts. Vectorised."""

from __future__ import annotations

import torch


def num_accepted(drafts: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Leading drafts equal to the target's tokens, per row: `drafts` [N, K] (padded with -1
    past each row's drafts), `sampled` [N, K + 1] the target's tokens at each scored position."""
    k = drafts.shape[1]
    match = (drafts == sampled[:, :k]) & (drafts >= 0)
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)


def rejection_sample(target_probs: torch.Tensor, drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
                     generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, K + 1] padded with -1, number accepted [N]).

    `target_probs` [N, K + 1, V], `drafts` [N, K], `draft_probs` [N, K, V] (None: one-hot on
    the drafts), `uniforms` [N, K] in [0, 1) for the accept tests; the recovery and bonus draws
    use `generator`."""
    n, k = drafts.shape
    p_draft = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # p(d_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q = torch.zeros_like(target_probs[:, :k]).scatter_(2, drafts.unsqueeze(2), 1.0)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        q = draft_probs
    accept = uniforms * q_draft < p_draft  # u < p / q without dividing by a zero q
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    residual = (target_probs[:, :k] - q).clamp_min(0.0)
    # p == q leaves no residual (and then the draft is always accepted): fall back to p
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    recovered = torch.multinomial(residual.reshape(n * k, -1), 1, generator=generator).view(n, k)
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator).view(n)
    out = torch.full((n, k + 1), -1, dtype=torch.int64, device=drafts.device)
    cols = torch.arange(k + 1, device=drafts.device)
    out[:, :k] = torch.where(cols[:k] < accepted.unsqueeze(1), drafts, out[:, :k])
    rows = torch.arange(n, device=drafts.device)
    last = torch.where(accepted < k, recovered[rows, accepted.clamp_max(k - 1)], bonus)
    out[rows, accepted] = last
    return out, accepted

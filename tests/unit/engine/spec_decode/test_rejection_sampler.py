"""Verification keeps the target's distribution: the general rejection sampler (drafts with a
proposal q) and the engine's path for deterministic drafts (the target samples every scored
position with the regular Sampler; drafts are kept while they equal its tokens), on a tiny
vocabulary with enough draws that a wrong rule is far outside the tolerance (a control shows
one is)."""

from __future__ import annotations

import torch

from kvserve.engine.sample.sampler import Sampler, SamplingMetadata
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.spec_decode.rejection_sampler import num_accepted, rejection_sample

N = 200_000
TOL = 0.01  # total variation; the sampling error at N draws is ~0.002


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_num_accepted():
    drafts = torch.tensor([[1, 2, 3], [1, 5, -1], [7, -1, -1], [4, 4, 4]])
    sampled = torch.tensor([[1, 2, 3, 4], [1, 2, 9, 9], [7, 8, 8, 8], [0, 4, 4, 4]])
    assert num_accepted(drafts, sampled).tolist() == [3, 1, 1, 0]


def test_general_rejection_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, 3, 5, generator=g) * 1.5, -1).expand(N, 3, 5)
    q = torch.softmax(torch.randn(1, 2, 5, generator=g) * 1.5, -1).expand(N, 2, 5)
    drafts = torch.stack([torch.multinomial(q[:, j], 1, generator=g).view(-1)
                          for j in range(2)], 1)
    out, accepted = rejection_sample(p, drafts, q, torch.rand(N, 2, generator=g), g)
    assert tv(torch.bincount(out[:, 0], minlength=5).float(), p[0, 0]) < TOL
    # the second token, where the first draft was kept, follows the second position's p
    kept = accepted >= 1
    assert tv(torch.bincount(out[kept, 1], minlength=5).float(), p[0, 1]) < TOL
    assert 0 < int(kept.sum()) < N  # both branches ran
    # control: keeping every draft gives q's distribution, which the check tells apart
    assert tv(torch.bincount(drafts[:, 0], minlength=5).float(), p[0, 0]) > 5 * TOL


def test_one_hot_rejection_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(1, 3, 4, generator=g), -1).expand(N, 3, 4)
    drafts = torch.tensor([[2, 0]]).expand(N, 2)
    out, accepted = rejection_sample(p, drafts, None, torch.rand(N, 2, generator=g), g)
    assert tv(torch.bincount(out[:, 0], minlength=4).float(), p[0, 0]) < TOL
    assert abs(float((accepted >= 1).float().mean()) - float(p[0, 0, 2])) < TOL


def test_engine_path_samples_the_target_distribution():
    """What the engine does for a drafted run: the Sampler draws at each position (here T=0.7,
    top_k=3, from raw logits), drafts are kept while equal. The emitted first token follows the
    processed p_0; the second, given the draft was kept, p_1."""
    torch.manual_seed(2)
    vocab, temperature = 6, 0.7
    logits = torch.randn(2, vocab) * 2
    params = SamplingParams(temperature=temperature, top_k=3)
    meta = SamplingMetadata.build([params] * (2 * N), [[]] * (2 * N), [[]] * (2 * N), {},
                                  vocab, "cpu")
    rows = logits.repeat_interleave(N, dim=0)
    sampled = Sampler()(rows, meta).sampled_token_ids.view(2, N).t()  # [N, 2]
    draft = int(logits[0].argsort()[-2])  # a likely, but not the likeliest, token
    drafts = torch.full((N, 1), draft)
    accepted = num_accepted(drafts, sampled)
    first = sampled[:, 0]  # the target's own token at position 0 (== the draft when kept)
    second = sampled[accepted == 1, 1]

    def processed(row: torch.Tensor) -> torch.Tensor:
        scaled = row / temperature
        cut = scaled.topk(3).values[-1]
        return torch.softmax(scaled.masked_fill(scaled < cut, float("-inf")), -1)

    p0, p1 = processed(logits[0]), processed(logits[1])
    assert tv(torch.bincount(first, minlength=vocab).float(), p0) < TOL
    assert tv(torch.bincount(second, minlength=vocab).float(), p1) < TOL
    assert abs(float(accepted.float().mean()) - float(p0[draft])) < TOL
    # control: a rule that keeps the draft whatever the target drew is far off p0
    always = torch.full_like(first, draft)
    assert tv(torch.bincount(always, minlength=vocab).float(), p0) > 5 * TOL

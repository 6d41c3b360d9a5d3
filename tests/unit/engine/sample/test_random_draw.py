"""The random draw: counter-based uniforms keyed by (seed, sample index, position), and the
inverse-CDF draw over a row's weights."""

from __future__ import annotations

import torch

from kvserve.engine.sample.random_draw import inverse_cdf, row_uniform, row_uniforms


def test_row_uniform_is_a_pure_function_of_its_key():
    assert row_uniform(1, 0, 5) == row_uniform(1, 0, 5)
    seeds = (-(2**63), -1, 0, 1, 2**63 - 1)
    keys = [(s, i, p) for s in seeds for i in (0, 1, 2) for p in (0, 1, 9)]
    values = [row_uniform(*k) for k in keys]
    assert len(set(values)) == len(keys)  # seed, index and position each change the draw
    assert all(0.0 <= v < 1.0 for v in values)


def test_row_uniforms_over_consecutive_positions_are_uniform():
    # chi-square over 20 bins of 20,000 consecutive positions (what one seeded stream draws)
    counts = [0] * 20
    for pos in range(20_000):
        counts[int(row_uniform(1234, 0, pos) * 20)] += 1
    chi2 = sum((c - 1000) ** 2 / 1000 for c in counts)
    assert chi2 < 43.82  # p = 0.001 at 19 degrees of freedom


def test_inverse_cdf_never_draws_a_token_of_weight_zero():
    # the extreme uniforms: 0 and the largest below 1; masked tokens at both ends and between
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 2.0, float("-inf")]] * 2)
    u = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert inverse_cdf(logits.clone(), u).tolist() == [1, 3]


def test_inverse_cdf_splits_the_unit_interval_by_weight():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]]).log_softmax(-1).repeat(4, 1)  # 1/4 each
    u = torch.tensor([0.1, 0.3, 0.6, 0.9], dtype=torch.float64)
    assert inverse_cdf(logits, u).tolist() == [0, 1, 2, 3]


def test_unseeded_rows_draw_from_the_global_generator_seeded_rows_keep_theirs():
    seeded = (torch.tensor([1]), torch.tensor([0.25], dtype=torch.float64))
    torch.manual_seed(0)
    a = row_uniforms(3, seeded, torch.device("cpu"))
    torch.manual_seed(0)
    b = row_uniforms(3, seeded, torch.device("cpu"))
    torch.manual_seed(1)
    c = row_uniforms(3, seeded, torch.device("cpu"))
    assert torch.equal(a, b) and a[1] == 0.25 and c[1] == 0.25 and c[0] != a[0]

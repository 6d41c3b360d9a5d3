"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, seeds, min_tokens and logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.sample import sampler as sampler_mod
from kvserve.engine.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    flat_token_index,
)
from kvserve.engine.sample.sampling_params import SamplingParams

CPU = torch.device("cpu")
INF = float("inf")


def build(params, vocab, prompts=None, outputs=None, sample_indices=None, eos=None):
    rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(rows)],
        outputs if outputs is not None else [[] for _ in range(rows)],
        sample_indices or {},
        vocab,
        CPU,
        eos_token_id=eos,
    )


def seeded_logits(seed: int, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def sample(logits, params, **kw):
    return Sampler()(logits, build(params, logits.shape[1], **kw))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was sampled"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001 for the degrees of freedom used below.
CHI2_999 = {2: 13.82, 3: 16.27, 5: 20.52, 7: 24.32}


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = seeded_logits(0, 16, 300)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None


def test_bf16_logits_sample_as_their_float32_widening():
    """A bf16 model hands the sampler bf16 logits (ties are common at 8 bits): plain greedy reads
    them as they are, every other path widens them first; both must pick what fp32 would."""
    logits = (seeded_logits(2, 8, 49152, scale=0.05)).bfloat16()
    logits[0, 9] = logits[0, 4] = logits[0].max() + 1  # a tie: the first index wins
    wide = logits.float()
    greedy = [SamplingParams(temperature=0.0)] * 8
    assert sample(logits, greedy).sampled_token_ids.tolist() == wide.argmax(dim=-1).tolist()
    assert int(sample(logits, greedy).sampled_token_ids[0]) == 4
    with_logprobs = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 8)
    assert torch.equal(with_logprobs.sampled_token_ids, wide.argmax(dim=-1))
    torch.testing.assert_close(with_logprobs.logprobs[:, 0],
                               wide.log_softmax(-1).max(dim=-1).values)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    torch.manual_seed(1)
    logits = seeded_logits(1, 12, 200, scale=0.1)  # flat: random rows rarely hit the argmax
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.0) for r in range(12)]
    out = sample(logits, params)
    greedy = out.sampled_token_ids[1::2]
    assert torch.equal(greedy, logits[1::2].argmax(dim=-1))
    assert not torch.equal(out.sampled_token_ids[0::2], logits[0::2].argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.05, 1.0, 7.0, 100.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = seeded_logits(2, 32, 500)
    out = sample(logits, [SamplingParams(temperature=temperature, top_k=1)] * 32)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [50, 3000])  # below and above TOP_P_CANDIDATES
def test_tiny_top_p_equals_greedy(vocab):
    logits = seeded_logits(3, 32, vocab, scale=0.5)
    out = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 32)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


# --- top-k / top-p sets -----------------------------------------------------------------------


def reference_kept(row: torch.Tensor, k: int, p: float) -> tuple[set[int], set[int]]:
    """(surely kept, possibly kept) token ids by definition, in fp64 on a full sort.

    Tokens whose "mass before" lies within 1e-9 of p may go either way under rounding.
    """
    values, order = row.double().sort(descending=True)
    values[k:] = -INF
    probs = values.softmax(dim=0)
    before = torch.cat([torch.zeros(1, dtype=torch.float64), probs.cumsum(0)[:-1]])
    finite = torch.isfinite(values)
    if p >= 1.0:
        sure = maybe = finite
    else:
        sure, maybe = finite & (before < p - 1e-9), finite & (before < p + 1e-9)
    # ties with the k-th value are kept too
    kth = row.double().sort(descending=True).values[min(k, row.numel()) - 1]
    ties = set(order[values.isneginf() & (row.double()[order] == kth)].tolist())
    return set(order[sure].tolist()), set(order[maybe].tolist()) | ties


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 120),
    ks=st.lists(st.integers(1, 130), min_size=3, max_size=3),
    ps=st.lists(st.sampled_from([0.05, 0.3, 0.7, 0.9, 0.999, 1.0]), min_size=3, max_size=3),
    scale=st.sampled_from([0.01, 1.0, 5.0]),
    width=st.sampled_from([4, 16, 1024]),
    full_sort=st.booleans(),
)
def test_top_k_top_p_mask_matches_definition(seed, vocab, ks, ps, scale, width, full_sort):
    """Each row's kept set equals the definition for its own k and p, whether it is solved on
    the candidates or by the full sort, whatever the other rows ask; and with every row sorted in
    full (a device's path: no host read of the unsolved rows)."""
    logits = seeded_logits(seed, 3, vocab, scale)
    ks = [min(k, vocab) for k in ks]
    top_p = torch.tensor(ps) if min(ps) < 1 else None
    masked = apply_top_k_top_p(logits.clone(), torch.tensor(ks), top_p, width, full_sort)
    for r in range(3):
        kept = set(torch.isfinite(masked[r]).nonzero().squeeze(1).tolist())
        sure, maybe = reference_kept(logits[r], ks[r], ps[r])
        assert sure <= kept <= maybe
        finite = torch.isfinite(masked[r])
        assert torch.equal(masked[r][finite], logits[r][finite])  # survivors are untouched


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 2000),
    k=st.integers(1, 60),
    p=st.sampled_from([0.2, 0.6, 0.95, 1.0]),
    temperature=st.sampled_from([0.3, 1.0, 3.0]),
)
def test_sampled_tokens_stay_inside_the_top_k_top_p_set(seed, vocab, k, p, temperature):
    torch.manual_seed(seed)
    rows = 200
    row = seeded_logits(seed, 1, vocab)[0]
    logits = row.expand(rows, vocab).contiguous()
    k = min(k, vocab)
    params = SamplingParams(temperature=temperature, top_k=k, top_p=p)
    out = sample(logits, [params] * rows)
    _, allowed = reference_kept(row / temperature, k, p)
    assert set(out.sampled_token_ids.tolist()) <= allowed


def test_top_p_batch_mixes_candidate_and_full_sort_rows():
    """A flat row needs the full sort, a peaked one does not; both must be right together."""
    vocab = 3000
    logits = torch.stack([seeded_logits(4, 1, vocab, 0.01)[0], seeded_logits(5, 1, vocab, 8.0)[0]])
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.9, 0.9]))
    for r in range(2):
        kept = set(torch.isfinite(masked[r]).nonzero().squeeze(1).tolist())
        sure, maybe = reference_kept(logits[r], vocab, 0.9)
        assert sure <= kept <= maybe
    assert torch.isfinite(masked[0]).sum() > sampler_mod.TOP_P_CANDIDATES  # really the fallback


# --- distributions ----------------------------------------------------------------------------


LOGITS_8 = torch.tensor([1.5, 0.2, -0.7, 2.1, 0.0, -1.5, 0.9, 1.1])


def draw_counts(params: SamplingParams, rows: int, seeded: bool = False) -> torch.Tensor:
    logits = LOGITS_8.expand(rows, 8).contiguous()
    batch = [dataclasses.replace(params, seed=10_000 + r) for r in range(rows)] if seeded \
        else [params] * rows
    out = sample(logits, batch)
    return torch.bincount(out.sampled_token_ids, minlength=8).double()


@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_match_softmax_over_temperature(seeded):
    torch.manual_seed(6)
    counts = draw_counts(SamplingParams(temperature=0.7), 20_000 if not seeded else 6_000, seeded)
    assert chi_square(counts, (LOGITS_8 / 0.7).softmax(-1)) < CHI2_999[7]
    # the test has power: the untempered distribution is rejected
    assert chi_square(counts, LOGITS_8.softmax(-1)) > 5 * CHI2_999[7]


def test_frequencies_match_the_renormalised_top_k_top_p_set():
    torch.manual_seed(7)
    # T=1 probs sorted: 3 (.33), 0 (.19), 7 (.12), 6 (.10), ...; top_k=4 then top_p=0.7
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=4, top_p=0.7), 20_000)
    probs = LOGITS_8.softmax(-1)
    top4 = torch.zeros(8)
    top4[[3, 0, 7, 6]] = probs[[3, 0, 7, 6]]
    top4 /= top4.sum()
    kept = torch.zeros(8)
    kept[[3, 0, 7]] = top4[[3, 0, 7]]  # mass before token 6 is .84 >= .7, so it goes
    assert chi_square(counts, kept / kept.sum()) < CHI2_999[2]


def test_min_p_filters_tokens_below_a_share_of_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4, 4).contiguous()
    masked = apply_min_p(logits.clone(), torch.tensor([0.0, 0.2, 0.5, 1.0]))
    assert torch.isfinite(masked).tolist() == [
        [True, True, True, True],
        [True, True, True, False],  # threshold 0.1
        [True, True, False, False],  # threshold 0.25
        [True, False, False, False],
    ]
    torch.manual_seed(8)
    rows = 8000
    out = sample(probs.log().expand(rows, 4).contiguous(), [SamplingParams(min_p=0.2)] * rows)
    counts = torch.bincount(out.sampled_token_ids, minlength=4).double()
    assert chi_square(counts, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95) < CHI2_999[2]


# --- seeds ------------------------------------------------------------------------------------


def run_seeded_row(
    position: int, neighbours: list[SamplingParams], mine: SamplingParams, steps: int = 12
) -> list[int]:
    """Tokens of one seeded row placed at `position` among `neighbours`, over several steps."""
    vocab = 2500  # above TOP_P_CANDIDATES: neighbours may need the full sort
    params = list(neighbours)
    params.insert(position, mine)
    tokens = []
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        logits = seeded_logits(100 + step, len(params), vocab, scale=1.5)
        logits[position] = seeded_logits(200 + step, 1, vocab, scale=1.5)[0]
        meta = SamplingMetadata.build(
            params, [[1, 2, 3]] * len(params), outputs, {}, vocab, CPU
        )
        sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
        tokens.append(sampled[position])
        outputs = [o + [t] for o, t in zip(outputs, sampled)]
    return tokens


@pytest.mark.parametrize(
    "mine",
    [
        SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234),
        SamplingParams(temperature=1.1, top_k=40, seed=1234),
        SamplingParams(temperature=1.0, min_p=0.02, repetition_penalty=1.2, seed=1234),
    ],
)
def test_same_seed_gives_same_tokens_anywhere_in_any_batch(mine):
    torch.manual_seed(9)
    alone = run_seeded_row(0, [], mine)
    crowd_a = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=77, min_p=0.1),
    ]
    crowd_b = [
        SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5, logprobs=3),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.5, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.99),
        SamplingParams(temperature=0.0, top_k=3),
    ]
    crowd_c = [SamplingParams(temperature=0.7, top_k=7), SamplingParams(temperature=1.0)]
    assert run_seeded_row(2, crowd_a, mine) == alone
    assert run_seeded_row(4, crowd_b, mine) == alone
    assert run_seeded_row(1, crowd_c, mine) == alone  # a batch without top-p
    other_seed = dataclasses.replace(mine, seed=4321)
    assert run_seeded_row(1, crowd_b, other_seed) != alone


def test_a_seeded_row_draws_by_its_position_not_by_its_history():
    """The token at an output position depends on (seed, sample index, position) and the
    logits alone: a row that starts at position 5 with another history of the same length
    draws what a row that got there step by step draws (a continuation's exactness)."""
    mine = SamplingParams(temperature=0.9, seed=77)
    vocab, steps = 500, 10
    logits = [seeded_logits(300 + s, 1, vocab, scale=1.0) for s in range(steps)]
    history: list[int] = []
    for s in range(steps):
        history.append(int(sample(logits[s], [mine], outputs=[list(history)])
                           .sampled_token_ids[0]))
    other = [7, 7, 7, 7, 7]
    for s in range(5, steps):
        tok = int(sample(logits[s], [mine], outputs=[list(other)]).sampled_token_ids[0])
        other.append(tok)
    assert other[5:] == history[5:]
    # the key has power: another sample index or another seed draws other tokens
    moved = [int(sample(logits[s], [mine], outputs=[history[:s]], sample_indices={0: 1})
                 .sampled_token_ids[0]) for s in range(steps)]
    reseeded = [int(sample(logits[s], [dataclasses.replace(mine, seed=78)],
                           outputs=[history[:s]]).sampled_token_ids[0]) for s in range(steps)]
    assert moved != history and reseeded != history


# --- penalties --------------------------------------------------------------------------------


def test_penalties_follow_the_formulas_on_a_hand_computed_case():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0], [2.0, -1.0, 0.5, -0.5, 3.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # same batch, no penalties: untouched
    ]
    meta = build(params, 5, prompts=[[0, 1], [0, 1]], outputs=[[2, 2, 3], [2, 2, 3]])
    got = apply_penalties(logits, meta)
    # seen (prompt or output) = {0,1,2,3}; output counts: 2 -> 2, 3 -> 1
    # 0: 2/2 = 1; 1: -1*2 = -2; 2: 0.5/2 - 0.25*2 - 0.5 = -0.75; 3: -0.5*2 - 0.25 - 0.5 = -1.75
    assert got[0].tolist() == [1.0, -2.0, -0.75, -1.75, 3.0]
    assert torch.equal(got[1], logits[1])


def test_presence_and_frequency_ignore_prompt_tokens_repetition_does_not():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    params = [
        SamplingParams(presence_penalty=1.0, frequency_penalty=1.0),
        SamplingParams(repetition_penalty=4.0),
    ]
    meta = build(params, 3, prompts=[[0], [0]], outputs=[[1], [1]])
    got = apply_penalties(logits, meta)
    assert got[0].tolist() == [1.0, -1.0, 1.0]
    assert got[1].tolist() == [0.25, 0.25, 1.0]


def test_frequency_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    greedy_freq = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert sample(logits, [greedy_freq], outputs=[[0]]).sampled_token_ids.item() == 0
    assert sample(logits, [greedy_freq], outputs=[[0, 0]]).sampled_token_ids.item() == 1


def test_flat_token_index_addresses_row_and_token_and_rejects_out_of_range_ids():
    assert flat_token_index([[1, 1, 3], [], [0]], 4, CPU).tolist() == [1, 1, 3, 8]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        flat_token_index([[4]], 4, CPU)


def dense_penalties(logits, prompts, outputs, rep, pres, freq):
    """The formulas, one row and one token at a time."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            count = outputs[r].count(t)
            x = out[r, t].item()
            if t in prompts[r] or count:
                x = x / rep[r] if x > 0 else x * rep[r]
            x -= freq[r] * count
            x -= pres[r] * (count > 0)
            out[r, t] = x
    return out


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), rows=st.integers(1, 5), vocab=st.integers(1, 12))
def test_penalties_match_the_formulas_on_random_histories(seed, rows, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2

    def history(n):
        return [torch.randint(vocab, (n,), generator=gen).tolist() for _ in range(rows)]

    prompts, outputs = history(4), history(6)
    rep = (torch.rand(rows, generator=gen) * 2 + 0.5).tolist()
    pres = (torch.rand(rows, generator=gen) * 4 - 2).tolist()
    freq = (torch.rand(rows, generator=gen) * 4 - 2).tolist()
    params = [
        SamplingParams(repetition_penalty=a, presence_penalty=b, frequency_penalty=c)
        for a, b, c in zip(rep, pres, freq)
    ]
    got = apply_penalties(logits, build(params, vocab, prompts=prompts, outputs=outputs))
    want = dense_penalties(logits, prompts, outputs, rep, pres, freq)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


# --- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
    ]
    outputs = [[3], [3], [3, 3]]  # rows 0 and 1 are under min_tokens, row 2 is not
    out = sample(logits, params, outputs=outputs, eos=0)
    assert out.sampled_token_ids.tolist() == [2, 0, 0]


def test_min_tokens_blocks_every_eos_id():
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=1)]
    assert sample(logits, params, eos=[0, 1]).sampled_token_ids.tolist() == [2]
    assert sample(logits, params, eos=[]).sampled_token_ids.tolist() == [0]


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_the_sampled_token_first():
    torch.manual_seed(10)
    logits = seeded_logits(11, 6, 40)
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.5, top_p=0.8, frequency_penalty=1.0),
    ] * 2
    out = sample(logits, params, prompts=[[1, 2]] * 6, outputs=[[3, 3]] * 6)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs.shape == (6, 4) and out.logprob_token_ids.shape == (6, 4)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids), atol=1e-6)
    top = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    sampled_lp = raw.gather(1, out.sampled_token_ids.unsqueeze(1))
    assert torch.equal(out.sampled_token_ranks, (raw >= sampled_lp).sum(dim=-1))


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = seeded_logits(12, 2, 30)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2)
    assert out.logprobs.shape == (2, 1)
    assert torch.equal(out.logprob_token_ids[:, 0], logits.argmax(-1))
    assert out.sampled_token_ranks.tolist() == [1, 1]


# --- metadata and contract --------------------------------------------------------------------


def test_build_normalises_top_k_and_sets_fast_path_flags():
    params = [
        SamplingParams(temperature=0.0, seed=1, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=-1, seed=2, logprobs=2),
        SamplingParams(temperature=0.8, top_k=500, logprobs=5),
    ]
    meta = build(params, 100)
    assert meta.top_k.tolist() == [100, 100, 100]
    assert meta.temperature.dtype == torch.float32 and meta.top_k.dtype == torch.int64
    assert meta.seeded[0].tolist() == [1]  # the greedy row draws nothing
    assert meta.seeded[1].dtype == torch.float64
    assert meta.max_num_logprobs == 5
    assert not meta.all_greedy and not meta.all_random
    assert meta.no_penalties and meta.output_token_ids is None and meta.prompt_token_ids is None
    assert meta.no_top_p_top_k_min_p  # the greedy row's top_p does not count
    with pytest.raises(ValueError, match="one prompt"):
        SamplingMetadata.build(params, [[]], [[]] * 3, {}, 100, CPU)


def test_sampler_never_modifies_the_callers_logits():
    logits = seeded_logits(13, 4, 64)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.2,
                       presence_penalty=0.3, min_tokens=3, logprobs=2),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
    ] * 2
    sample(logits, params, prompts=[[1]] * 4, outputs=[[2]] * 4, eos=0)
    assert torch.equal(logits, before)

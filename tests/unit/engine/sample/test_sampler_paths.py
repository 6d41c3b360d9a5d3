"""Sampler paths test_sampler.py leaves open (mutation survivors, see docs/mutation.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine.sample.sampler import (
    Sampler, SamplingMetadata, apply_top_k_top_p, flat_token_index,
)
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.kernels import checks

CPU = torch.device("cpu")


def test_flat_token_index_rejects_a_negative_id():
    # -1 would address the previous row's last token (row * vocab - 1).
    with pytest.raises(ValueError, match=r"\[0, 4\).*got \[-1, 2\]"):
        flat_token_index([[2], [-1]], 4, CPU)


def test_logit_bias_ids_past_the_vocabulary_are_skipped():
    # The request's check knows the tokenizer, not the logits' width: an id at or past the width
    # is skipped here, never indexed.
    params = SamplingParams(temperature=0.0, logit_bias={3: 5.0, 4: 100.0, 9: 100.0})
    meta = SamplingMetadata.build([params], [[]], [[]], {}, 4, CPU)
    rows, tokens, values = meta.logit_bias
    assert tokens.tolist() == [3] and values.tolist() == [5.0]
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [3]


def test_a_finished_grammar_lets_eos_through_min_tokens_and_an_open_one_does_not():
    # EOS (3) is blocked under min_tokens in both rows. Row 0's grammar allows only EOS (it is
    # finished): every token would be -inf, so EOS wins. Row 1's allows 1 and 3: EOS stays
    # blocked, although its logit is the row's largest.
    eos, vocab = 3, 8
    params = [SamplingParams(temperature=0.0, min_tokens=5)] * 2
    meta = SamplingMetadata.build(params, [[], []], [[], []], {}, vocab, CPU, eos_token_id=eos)
    mask = torch.tensor([[1 << eos], [(1 << 1) | (1 << eos)]], dtype=torch.int32)
    meta = dataclasses.replace(meta, token_bitmask=([0, 1], mask))
    logits = torch.tensor([[5.0, 4, 3, 2, 1, 0, 0, 0], [0.0, 1, 2, 9, 0, 0, 0, 0]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [eos, 1]


HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero,
              torch.nonzero, torch.Tensor.__len__}


class OnDevice(torch.Tensor):
    """A CPU tensor standing for a GPU's (as in worker/test_gpu_step.py): host reads recorded."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            cls.reads.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_top_k_top_p_on_a_device_sorts_in_full_and_reads_nothing_back(monkeypatch):
    # On a device (full_sort left to its default) the candidate pre-pass, which reads the width
    # and the unsolved rows on the host, is skipped; the mask is the CPU path's.
    monkeypatch.setattr(checks, "host_readable", lambda t: not isinstance(t, OnDevice))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    k, p = torch.tensor([50, 7, 50]), torch.tensor([0.9, 1.0, 0.5])
    expected = apply_top_k_top_p(logits.clone(), k, p, candidates=8)
    OnDevice.reads = []
    got = apply_top_k_top_p(logits.clone().as_subclass(OnDevice), k.as_subclass(OnDevice),
                            p.as_subclass(OnDevice), candidates=8)
    assert OnDevice.reads == []
    assert torch.equal(got.as_subclass(torch.Tensor), expected)


# ---- survivors of the 2026-12-06 run ------------------------------------------------------------

def test_a_logit_bias_is_added_to_the_logit_and_token_0_takes_one():
    # +2 on token 1 (logit 4) lifts it over token 0 (logit 5): added, not set to 2. A bias on
    # token 0 counts like any other.
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    lifted = SamplingParams(temperature=0.0, logit_bias={1: 2.0})
    meta = SamplingMetadata.build([lifted], [[]], [[]], {}, 4, CPU)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1]
    sunk = SamplingParams(temperature=0.0, logit_bias={0: -2.0})
    meta = SamplingMetadata.build([sunk], [[]], [[]], {}, 4, CPU)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1]


def test_a_top_k_of_0_set_after_construction_is_off():
    # SamplingParams maps top_k=0 to -1 when built; one set afterwards passes verify() (the
    # engine's check) and must mean "off" too: the same draws as -1 under the same seeds.
    off = SamplingParams(temperature=1.0, top_k=-1, seed=5)
    zero = SamplingParams(temperature=1.0, seed=5)
    zero.top_k = 0
    zero.verify()
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))

    def draws(params):
        rows = {r: r for r in range(8)}  # one seeded draw per row: sample indices 0..7
        meta = SamplingMetadata.build([params] * 8, [[]] * 8, [[]] * 8, rows, 16, CPU)
        return Sampler()(logits, meta).sampled_token_ids.tolist()

    assert draws(zero) == draws(off)


def test_a_temperature_of_exactly_the_greedy_threshold_is_sampled_as_the_params_say():
    # SamplingParams.greedy is temperature < 1e-5; at 1e-5 exactly a row is sampled at that
    # temperature, alone in its batch or next to a greedy row: its two tied top logits both come
    # up across seeds (the argmax would always take the first), and the third, 0.01 below them,
    # never does (it would at temperature 1).
    params = SamplingParams(temperature=1e-5, seed=3)
    assert not params.greedy
    rows = 32
    logits = torch.tensor([[3.0, 3.0, 2.99, 0.0]]).repeat(rows + 1, 1)
    for batch in ([params] * rows, [params] * rows + [SamplingParams(temperature=0.0)]):
        indices = {r: r for r in range(rows)}  # rows differ by their sample index
        n = len(batch)
        meta = SamplingMetadata.build(batch, [[]] * n, [[]] * n, indices, 4, CPU)
        assert not meta.all_greedy
        sampled = Sampler()(logits[:n], meta).sampled_token_ids.tolist()
        assert set(sampled[:rows]) == {0, 1} and sampled[rows:] in ([], [0])


def test_metadata_built_by_hand_with_the_optional_flags_left_applies_every_filter():
    # The optional flags only enable fast paths: left at their defaults, min_p, top_k and top_p
    # are all applied. Row 0: min_p 0.5 keeps the tokens within log(2) of the top (0, 1);
    # row 1: top_k 1; row 2: top_p 0.5 keeps token 0 alone (its probability is above 0.5).
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0], [2.0, 1.5, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]])
    rows = 3
    f = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    meta = SamplingMetadata(
        temperature=f(1, 1, 1), top_p=f(1, 1, 0.5), top_k=torch.tensor([4, 1, 4]),
        min_p=f(0.5, 0, 0), presence_penalty=f(0, 0, 0), frequency_penalty=f(0, 0, 0),
        repetition_penalty=f(1, 1, 1), prompt_token_ids=None, output_token_ids=None,
        seeded=None, max_num_logprobs=None, all_greedy=False, all_random=True,
        no_penalties=True, no_top_p_top_k_min_p=False)
    seen = [set() for _ in range(rows)]
    for seed in range(64):
        torch.manual_seed(seed)
        for r, tok in enumerate(Sampler()(logits, meta).sampled_token_ids.tolist()):
            seen[r].add(tok)
    assert seen == [{0, 1}, {0}, {0}]


def test_a_batch_of_seeded_rows_draws_nothing_from_the_global_generator():
    # Each seeded row's uniform comes from its key; the global generator is left as it was,
    # so unseeded requests draw the same whatever seeded ones ran before them.
    params = SamplingParams(temperature=1.0, seed=0)
    meta = SamplingMetadata.build([params] * 3, [[]] * 3, [[]] * 3, {0: 0, 1: 1, 2: 2}, 8, CPU)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    Sampler()(torch.zeros(3, 8), meta)
    assert torch.equal(torch.get_rng_state(), state)


def test_min_tokens_blocks_eos_in_every_row_under_it_whatever_the_rows_before():
    # Row 0 is past its min_tokens; rows 1 and 2 are not: EOS (3) stays blocked in both. A stop
    # id at the logits' width (a tokenizer larger than the model) is skipped, never indexed.
    eos, vocab = 3, 4
    done = SamplingParams(temperature=0.0, min_tokens=1)
    under = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[vocab])
    meta = SamplingMetadata.build([done, under, under], [[]] * 3, [[7], [7], []], {}, vocab, CPU,
                                  eos_token_id=eos)
    rows, tokens = meta.min_tokens_block
    assert rows.tolist() == [1, 2] and tokens.tolist() == [eos, eos]
    logits = torch.tensor([[0.0, 1, 2, 9]]).repeat(3, 1)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [eos, 2, 2]

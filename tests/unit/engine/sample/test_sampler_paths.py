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

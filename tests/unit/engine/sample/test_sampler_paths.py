"""Sampler paths test_sampler.py leaves open (mutation survivors, see docs/mutation.md)."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.sample.sampler import Sampler, SamplingMetadata, flat_token_index
from kvserve.engine.sample.sampling_params import SamplingParams

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

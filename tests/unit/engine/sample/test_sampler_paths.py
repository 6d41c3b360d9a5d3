"""Sampler paths test_sampler.py leaves open (mutation survivors, see docs/mutation.md)."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.sample.sampler import flat_token_index

CPU = torch.device("cpu")


def test_flat_token_index_rejects_a_negative_id():
    # -1 would address the previous row's last token (row * vocab - 1).
    with pytest.raises(ValueError, match=r"\[0, 4\).*got \[-1, 2\]"):
        flat_token_index([[2], [-1]], 4, CPU)

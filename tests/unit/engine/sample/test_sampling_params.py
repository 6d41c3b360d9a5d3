"""SamplingParams: vLLM defaults, normalisation and typed validation errors."""

from __future__ import annotations

import pytest

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sample.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.seed is None and p.logprobs is None
    assert p.stop_strings == [] and p.stop_token_ids == [] and not p.greedy


def test_normalisation():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_values_raise_a_typed_error_naming_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)  # callers catching ValueError still work


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"n": True}, "n"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"stop": [1]}, "stop"),
    ],
)
def test_nan_infinity_and_out_of_range_seeds_are_refused_offline_too(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_the_ends_of_the_seed_range_are_valid():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_verify_catches_a_value_changed_after_construction():
    p = SamplingParams(seed=1)
    p.seed = 2**64
    with pytest.raises(InvalidRequestError, match="seed"):
        p.verify()

"""speculative_config as vLLM takes it: its forms, its defaults, and refusals by name."""

from __future__ import annotations

import pytest

from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import ConfigError
from kvserve.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config


def test_forms_and_defaults():
    a = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    b = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert a == b and (a.prompt_lookup_min, a.prompt_lookup_max) == (5, 5)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    s = parse_speculative_config({"method": "suffix"})
    assert s.num_speculative_tokens == s.suffix_decoding_max_tree_depth == 24
    assert parse_speculative_config({"model": "draft", "num_speculative_tokens": 2}).method \
        == "draft_model"
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert isinstance(cfg.speculative_config, SpeculativeConfig)


@pytest.mark.parametrize("value,words", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "suffix", "prompt_lookup_max": 2}, "are for method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3},
     "are for method 'suffix'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "is for a draft model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ">= 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown field(s) ['typo']"),
    ({}, "needs a method"),
    ("{not json", "must be a JSON object"),
])
def test_refusals_name_the_problem(value, words):
    with pytest.raises(ConfigError) as err:
        parse_speculative_config(value)
    assert words in str(err.value)


def test_engine_refusals():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="async-scheduling"):  # a host-side proposer only
        EngineConfig(speculative_config={"method": "eagle3", "model": "m",
                                         "num_speculative_tokens": 2}, async_scheduling=True)
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size must be 1 or"):
        EngineConfig(speculative_config={"method": "draft_model", "model": "m",
                                         "num_speculative_tokens": 2,
                                         "draft_tensor_parallel_size": 2})


def test_serve_flag_and_engine_args():
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.service.serve_args import build_serve_parser, engine_config_from_args

    args = build_serve_parser().parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_config_from_args(args).speculative_config.num_speculative_tokens == 4
    cfg = EngineArgs(speculative_config={"method": "suffix"}).create_engine_config()
    assert cfg.speculative_config.method == "suffix"

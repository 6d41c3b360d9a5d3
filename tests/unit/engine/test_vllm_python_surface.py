"""vLLM's Python surface beyond LLM and SamplingParams: EngineArgs / AsyncEngineArgs and their
CLI, FlexibleArgumentParser, LLMEngine.from_engine_args, LLM(**EngineArgs fields), vLLM's import
paths, Logprob objects, get_metrics and reset_prefix_cache, on the tiny random Llama."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import ConfigError


def test_vllm_import_paths_resolve_to_the_same_objects():
    from kvserve import LLM, Logprob, SamplingParams
    from kvserve.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: F401
    from kvserve.engine.llm_engine import LLMEngine  # noqa: F401
    from kvserve.logprobs import Logprob as L2
    from kvserve.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from kvserve.sampling_params import SamplingParams as S2
    from kvserve.utils import FlexibleArgumentParser  # noqa: F401

    assert S2 is SamplingParams and L2 is Logprob and LLM.__module__ == "kvserve.engine.llm"


def test_engine_args_mirror_engine_config_and_its_cli():
    from kvserve.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from kvserve.utils import FlexibleArgumentParser

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= names
    assert EngineArgs().create_engine_config() == EngineConfig()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--max_model_len=512", "--max-num-seqs", "4",
                              "--hf-overrides", "{\"rms_norm_eps\": 0.5}",
                              "--logits-processors", "pkg.mod:Proc",
                              "--no-enable-prefix-caching", "--swap-space", "0.5",
                              "--disable-log-stats"])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.enable_prefix_caching,
            cfg.swap_space) == ("m", 512, 4, False, 0.5)
    assert cfg.hf_overrides == {"rms_norm_eps": 0.5} and cfg.logits_processors == ["pkg.mod:Proc"]
    assert AsyncEngineArgs(model="m", disable_log_requests=False).create_engine_config() == \
        EngineConfig(model="m")
    with pytest.raises(ConfigError, match="block_size"):
        EngineArgs(block_size=7).create_engine_config()


def test_llm_takes_engine_args_fields_and_refuses_unknown_ones_by_name(llm, tiny_model_dir):
    from kvserve import LLM, SamplingParams
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, kv_cache_memory=8 << 20,
                      dtype="float32", disable_log_stats=True)
    other = LLM(**dataclasses.asdict(args))
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert other.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert LLMEngine.from_engine_args(args).max_model_len == 256
    with pytest.raises(ConfigError, match="not_an_engine_argument"):
        LLM(model=str(tiny_model_dir), not_an_engine_argument=2)


def test_metrics_and_prefix_cache_reset(llm):
    from kvserve import SamplingParams

    prompt = "The same long prefix, repeated twice to hit the cache. " * 4
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([prompt], params, use_tqdm=False)
    before = {m.name: m.value for m in llm.get_metrics()}
    llm.generate([prompt], params, use_tqdm=False)
    after = {m.name: m for m in llm.get_metrics()}
    assert after["vllm:prefix_cache_hits"].value > before["vllm:prefix_cache_hits"]
    assert type(after["vllm:prefix_cache_hits"]).__name__ == "Counter"
    assert type(after["vllm:num_requests_running"]).__name__ == "Gauge"
    assert after["vllm:prompt_tokens"].value > before["vllm:prompt_tokens"]
    assert llm.reset_prefix_cache() is True
    hits = after["vllm:prefix_cache_hits"].value
    llm.generate([prompt], params, use_tqdm=False)
    assert {m.name: m.value for m in llm.get_metrics()}["vllm:prefix_cache_hits"] == hits

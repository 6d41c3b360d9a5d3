"""vLLM's LLM extras on the tiny random Llama: hf_overrides (dict or callable over the HF config,
applied before the model is built) and start_profile / stop_profile (torch profiler traces)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_llm
from kvserve import SamplingParams
from kvserve.engine.errors import ConfigError

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def hf_greedy(model_dir, **overrides) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              **overrides).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    gen = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    return gen[0, ids.shape[1]:].tolist()


def test_hf_overrides_dict_changes_the_model_as_hf_does(llm, tiny_model_dir):
    eps = make_llm(tiny_model_dir, hf_overrides={"rms_norm_eps": 10.0})
    assert eps.llm_engine.hf_config.rms_norm_eps == 10.0
    got = eps.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    plain = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(tiny_model_dir, rms_norm_eps=10.0)
    assert got != plain
    eps.shutdown()


def test_hf_overrides_callable_and_bad_values(tiny_model_dir):
    def big_eps(cfg):
        cfg.rms_norm_eps = 3.0
        return cfg

    llm = make_llm(tiny_model_dir, hf_overrides=big_eps)
    assert llm.llm_engine.hf_config.rms_norm_eps == 3.0
    got = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(tiny_model_dir, rms_norm_eps=3.0)
    llm.shutdown()
    with pytest.raises(ConfigError, match="hf_overrides"):
        make_llm(tiny_model_dir, hf_overrides=["num_hidden_layers", 1])
    with pytest.raises(ConfigError, match="JSON object"):
        make_llm(tiny_model_dir, hf_overrides="{not json")


@pytest.mark.parametrize("env", ["KVSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR"])
def test_start_stop_profile_writes_a_trace_of_the_model_ops(llm, tmp_path, monkeypatch, env):
    import json

    for name in ("KVSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="KVSERVE_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv(env, str(tmp_path / "traces"))
    llm.start_profile()
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.stop_profile()
    traces = list((tmp_path / "traces").glob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"aten::embedding", "aten::mul"} <= names  # the embedding, RMSNorm
    with pytest.raises(ConfigError, match="without start_profile"):
        llm.stop_profile()


def test_hf_overrides_reach_every_tensor_parallel_rank(tiny_model_dir):
    """Rank 1 builds its shard from the overridden config too: the sharded model's greedy tokens
    are HF's with the same override."""
    tp = make_llm(tiny_model_dir, tensor_parallel_size=2, hf_overrides={"rms_norm_eps": 10.0})
    got = tp.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tp.shutdown()
    assert got == hf_greedy(tiny_model_dir, rms_norm_eps=10.0)


def test_output_past_the_context_stops_there_as_vllm_v1(tiny_model_dir):
    """prompt + max_tokens > max_model_len: the output ends at the context, finish_reason
    "length" (vLLM v1's engine); a prompt that fills the context is still refused."""
    llm = make_llm(tiny_model_dir, max_model_len=32)
    prompt = llm.get_tokenizer()(PROMPT).input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 32 - len(prompt) and out.finish_reason == "length"
    with pytest.raises(Exception, match="max_model_len"):
        llm.generate({"prompt_token_ids": prompt * 8}, GREEDY, use_tqdm=False)


def test_reset_prefix_cache_with_running_requests_preempts_them(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.llm_engine
    engine.add_request("a", PROMPT * 4, GREEDY)
    engine.step()  # prefilled: its full blocks are cached and held
    assert not llm.reset_prefix_cache()  # a running request holds blocks (as vLLM)
    assert llm.reset_prefix_cache(reset_running_requests=True)
    assert engine.scheduler.num_preemptions == 1 and not engine.kv.pool.cached
    expected = tokens_of(make_llm(tiny_model_dir).generate(PROMPT * 4, GREEDY, use_tqdm=False))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert tokens_of(done) == expected  # recomputed, same greedy tokens


def test_engine_seed_sets_the_global_generators_as_vllm():
    """LLM(seed=...) seeds Python's, numpy's and torch's generators at start, so a script that
    draws after building its LLM draws the same numbers every run."""
    import random

    import numpy as np

    from kvserve.engine.worker.startup import set_random_seed

    draws = []
    for _ in range(2):
        set_random_seed(42)
        draws.append((random.random(), float(np.random.rand()), torch.rand(1).item()))
    assert draws[0] == draws[1]


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]

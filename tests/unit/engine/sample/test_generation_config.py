"""Default sampling from generation_config.json (vLLM's --generation-config auto)."""

from __future__ import annotations

import json
import shutil

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.errors import ConfigError
from kvserve.engine.sample.generation_config import sampling_defaults
from kvserve.engine.worker.model_loader import _write_sampling
from kvserve.service.chat_request import ChatCompletionRequest


def test_reads_only_the_keys_the_file_sets(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 64, "do_sample": True,
         "top_k": None, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64}
    assert sampling_defaults(tmp_path, "vllm") == {}
    assert sampling_defaults(tmp_path / "nothing-here") == {}
    with pytest.raises(ConfigError, match="generation-config"):
        sampling_defaults(tmp_path, str(tmp_path / "missing"))


def test_a_request_s_own_values_win_over_the_defaults():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=0.5)
    p = req.sampling_params(8, None, {"temperature": 0.2, "top_p": 0.9, "max_tokens": 3})
    assert (p.temperature, p.top_p, p.max_tokens) == (0.2, 0.5, 8)
    assert req.sampling_params(8, None).temperature == 1.0  # OpenAI's default without a config


def test_fetch_model_writes_the_recommended_sampling_once(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    _write_sampling(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    data = json.loads((tmp_path / "generation_config.json").read_text())
    assert data == {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9, "do_sample": True}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7}')
    _write_sampling(tmp_path, {"temperature": 0.2})  # a value already there is kept
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"temperature": 0.7}


def test_offline_default_params_come_from_the_model(tiny_model_dir, tmp_path):
    model = tmp_path / "greedy-by-default"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0,
                                                              "max_new_tokens": 12}))
    llm = LLM(str(model), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    assert llm.get_default_sampling_params().temperature == 0.0
    default = llm.generate(["Hello world"] * 2, use_tqdm=False)
    greedy = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12),
                          use_tqdm=False)
    assert default[0].outputs[0].token_ids == default[1].outputs[0].token_ids == \
        greedy[0].outputs[0].token_ids

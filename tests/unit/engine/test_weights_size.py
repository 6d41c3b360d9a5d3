"""Sizing from a checkpoint's own files: safetensors headers (bytes per dtype, every expert,
shards, quantised storage) and config.json (parameters, KV heads, layer groups), against the real
tensors of tiny models built with transformers' own classes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from tiny_families import FAMILIES, build_family, tensor_bytes

from kvserve.engine.sizing.memory import LayerGroup, group_blocks, plan_memory, request_kv_bytes
from kvserve.engine.sizing.model_shape import head_dim, kv_heads, layer_groups, parameter_count
from kvserve.engine.sizing.weights_size import (
    CheckpointReadError, checkpoint_weight_bytes, local_checkpoint, read_header,
)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(name, root / name) for name in FAMILIES}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_headers_give_the_real_tensor_bytes_and_parameters(families, name: str) -> None:
    folder, model = families[name]
    weights = local_checkpoint(folder).weights
    assert weights.total_bytes == tensor_bytes(folder) == checkpoint_weight_bytes(folder)
    # Every parameter of the HF model, each expert included, tied matrices once.
    assert weights.parameters == sum(p.numel() for p in model.parameters())
    assert weights.bytes_by_dtype == {"F32": 4 * weights.parameters}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parameter_count_from_config_alone_matches_the_model(families, name: str) -> None:
    folder, model = families[name]
    config = json.loads((folder / "config.json").read_text())
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_sharded_checkpoint_is_read_through_its_index(tmp_path: Path) -> None:
    folder, model = build_family("mixtral", tmp_path / "sharded", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    checkpoint = local_checkpoint(folder)
    assert checkpoint.weights.num_files == len(list(folder.glob("*.safetensors")))
    assert checkpoint.weights.total_bytes == tensor_bytes(folder)
    assert checkpoint.weights.parameters == sum(p.numel() for p in model.parameters())


def test_quantised_storage_counts_at_its_stored_bytes(tmp_path: Path) -> None:
    """A W4A16-style layout: int32-packed weights, bf16 group scales, an fp8 tensor, a bf16
    embedding. Cast to a 2-byte compute dtype only the floating tensors change size."""
    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.zeros(64, 32, dtype=torch.bfloat16),
               "layer.weight_packed": torch.zeros(32, 4, dtype=torch.int32),  # 32x32 4-bit
               "layer.weight_scale": torch.zeros(32, 1, dtype=torch.bfloat16),
               "other.weight": torch.zeros(16, 16, dtype=torch.float8_e4m3fn)}
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors, tmp_path / "model.safetensors")
    weights = local_checkpoint(tmp_path).weights
    stored = {"BF16": (64 * 32 + 32) * 2, "I32": 32 * 4 * 4, "F8_E4M3": 256}
    assert weights.bytes_by_dtype == stored
    assert weights.resident_bytes() == sum(stored.values())
    assert weights.resident_bytes(4) == (64 * 32 + 32) * 4 + 32 * 4 * 4 + 256


def test_tied_lm_head_stored_anyway_is_counted_once(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    emb = torch.zeros(64, 16)
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert local_checkpoint(tmp_path).weights.parameters == 64 * 16
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert local_checkpoint(tmp_path).weights.parameters == 2 * 64 * 16


def test_unreadable_checkpoints_say_what_failed(tmp_path: Path) -> None:
    with pytest.raises(CheckpointReadError, match="no config.json"):
        local_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointReadError, match="no \\*.safetensors"):
        local_checkpoint(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointReadError, match="header length"):
        read_header(bad)
    bad.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(CheckpointReadError, match="not JSON"):
        read_header(bad)


def test_layer_groups_follow_each_familys_rules(families) -> None:
    def groups(name: str) -> tuple:
        return layer_groups(json.loads((families[name][0] / "config.json").read_text()))

    assert groups("gemma3") == (LayerGroup(1, None), LayerGroup(5, 32))  # 5 local : 1 global
    assert groups("gemma2") == (LayerGroup(2, None), LayerGroup(2, 32))  # alternating
    assert groups("gpt_oss") == (LayerGroup(2, None), LayerGroup(2, 32))
    assert groups("qwen3") == (LayerGroup(4, None),)
    # Configs written before `layer_types` existed, by the family's own rule.
    assert layer_groups({"model_type": "gemma2", "num_hidden_layers": 4,
                         "sliding_window": 8}) == (LayerGroup(2, None), LayerGroup(2, 8))
    assert layer_groups({"model_type": "gemma3_text", "num_hidden_layers": 12,
                         "sliding_window": 8, "sliding_window_pattern": 6}) == (
        LayerGroup(2, None), LayerGroup(10, 8))
    assert layer_groups({"model_type": "mistral", "num_hidden_layers": 4,
                         "sliding_window": 4096}) == (LayerGroup(4, 4096),)
    assert layer_groups({"model_type": "qwen2", "num_hidden_layers": 6, "sliding_window": 64,
                         "use_sliding_window": True, "max_window_layers": 2}) == (
        LayerGroup(2, None), LayerGroup(4, 64))
    assert layer_groups({"model_type": "qwen2", "num_hidden_layers": 6, "sliding_window": 64,
                         "use_sliding_window": False, "max_window_layers": 2}) == (
        LayerGroup(6, None),)
    multimodal = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "hidden_size": 64}}
    assert layer_groups(multimodal) == (LayerGroup(1, None), LayerGroup(5, 8))
    assert (kv_heads(multimodal["text_config"]), head_dim(multimodal["text_config"])) == (4, 32)


def test_sliding_layers_cap_at_their_window_by_hand() -> None:
    assert group_blocks(100, 16, None) == 7
    assert group_blocks(100, 16, 32) == 3  # ceil(31/16) + 1: the window and a straddled block
    assert group_blocks(20, 16, 32) == 2  # a short request never holds more than its tokens
    groups = (LayerGroup(1, None), LayerGroup(5, 32))
    per_layer_block = 2 * 2 * 16 * 2 * 16  # K+V, 2 KV heads, head_dim 16, bf16, 16 tokens
    assert request_kv_bytes(groups, 100, 16, 2, 16, 2) == per_layer_block * (7 + 5 * 3)
    assert request_kv_bytes(groups, 100, 16, 2, 16, 2, windowed=False) == per_layer_block * 42


def test_plan_counts_concurrency_with_and_without_window_capping() -> None:
    kw = dict(total_bytes=1 << 30, gpu_memory_utilization=1.0, weight_bytes=0,
              activation_peak=0, num_layers=6, num_kv_heads=2, head_dim=16, kv_dtype_bytes=2,
              block_size=16, tokens_per_request=4096)
    full = plan_memory(**kw)
    windowed = plan_memory(**kw, layer_groups=(LayerGroup(1, None), LayerGroup(5, 32)))
    per_layer_block = 2 * 2 * 16 * 2 * 16
    assert full.max_concurrency == windowed.max_concurrency == (1 << 30) // (
        6 * per_layer_block) * 16 // 4096
    assert windowed.max_concurrency_windowed == (1 << 30) // (per_layer_block * (256 + 5 * 3))
    assert windowed.max_concurrency_windowed > 4 * full.max_concurrency
    assert full.max_concurrency_windowed == full.max_concurrency  # no sliding layers

"""The operator's plan and the real engine agree: its flags start an engine with its blocks, on one
rank and on N tensor-parallel ranks."""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.operator.resources import engine_args
from kvserve.operator.sizing import plan
from kvserve.operator.spec import parse_spec


def tiny_service(model_dir: Path, memory: str) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    params = (model_dir / "model.safetensors").stat().st_size // 4  # float32 weights
    return {
        "metadata": {"name": "tiny", "namespace": "ml", "uid": "u"},
        "spec": {"device": "cpu", "resources": {"limits": {"memory": memory}},
                 "engine": {"maxModelLen": 256, "maxNumSeqs": 4},
                 "model": {"name": "tiny", "uri": str(model_dir), "architecture": {
                     "layers": cfg["num_hidden_layers"], "kvHeads": cfg["num_key_value_heads"],
                     "headDim": cfg["hidden_size"] // cfg["num_attention_heads"],
                     "heads": cfg["num_attention_heads"], "hiddenSize": cfg["hidden_size"],
                     "intermediateSize": cfg["intermediate_size"],
                     "vocabSize": cfg["vocab_size"], "parameters": params,
                     "maxModelLen": cfg["max_position_embeddings"]}}},
    }


def test_engine_started_with_the_operator_flags_has_the_planned_blocks(
        tiny_model_dir: Path) -> None:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.service.cli import build_parser, engine_config_from_args

    spec = parse_spec(tiny_service(tiny_model_dir, "64Mi"))
    sizing = plan(spec)
    config = engine_config_from_args(build_parser().parse_args(engine_args(spec, sizing)))
    engine = LLMEngine.from_config(config)
    budget = engine.memory_budget
    assert budget.bytes_per_block == sizing.bytes_per_block
    assert budget.num_blocks == sizing.num_blocks > 0
    assert budget.max_concurrency == sizing.max_concurrency
    assert engine.max_model_len == 256 and engine.block_size == 16


def test_engine_started_with_the_operator_flags_for_n_gpus_has_the_planned_blocks(
        tiny_model_dir: Path, monkeypatch) -> None:
    """A GPU spec the tiny model needs 2 GPUs for: the 2-rank engine (gloo on this CPU, each rank
    budgeted as a GPU of the spec's size) allocates exactly the blocks in the operator's status."""
    import torch

    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.models import model_class_for
    from kvserve.engine.worker.model_loader import load_config
    from kvserve.service.cli import build_parser, engine_config_from_args

    hf = load_config(tiny_model_dir)
    meta = model_class_for(hf)(hf, dtype=torch.float32, device=torch.device("meta"))
    body = tiny_service(tiny_model_dir, "64Mi")
    body["spec"].update(device="cuda", gpu={"memoryGiB": 1, "maxPerReplica": 8})
    body["spec"]["engine"] = {"maxModelLen": 512, "maxNumSeqs": 200, "dtype": "float32",
                              "gpuMemoryUtilization": 0.05}
    body["spec"]["model"]["architecture"]["parameters"] = sum(p.numel() for p in meta.parameters())
    spec = parse_spec(body)
    sizing = plan(spec)
    assert sizing.gpus_per_replica == 2  # one GPU's 51 MiB holds too few blocks
    args = engine_args(spec, sizing)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    config = engine_config_from_args(build_parser().parse_args(args))
    monkeypatch.setenv("KVSERVE_DEVICE_MEMORY", str(spec.gpu_memory_bytes))
    engine = LLMEngine.from_config(config)
    try:
        budget = engine.memory_budget
        assert budget.bytes_per_block * 2 == sizing.bytes_per_block  # per rank x 2 ranks
        assert budget.num_blocks == sizing.num_blocks > 0
        assert budget.max_concurrency == sizing.max_concurrency
        assert engine.runner.kv.shape[2] == sizing.num_blocks  # what each rank allocated
    finally:
        engine.shutdown()

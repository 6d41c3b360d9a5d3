"""The operator's plan and the real engine agree: its flags start an engine with its blocks."""

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

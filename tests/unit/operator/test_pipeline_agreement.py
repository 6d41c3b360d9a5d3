"""The operator's plan of a pipeline-parallel replica and the real engine agree: its flags
(--pipeline-parallel-size 2, two stages of one GPU each) start an engine whose per-stage
budget holds the blocks in status.sizing (gloo on this CPU, each rank budgeted as a GPU of
the spec's size)."""

from __future__ import annotations

from pathlib import Path

from kvserve.operator.model_files import ModelReader
from kvserve.operator.resources import engine_args
from kvserve.operator.sizing import plan
from kvserve.operator.spec import parse_spec


def test_a_two_stage_plan_is_what_the_engine_allocates(tiny_model_dir: Path,
                                                        monkeypatch) -> None:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.service.cli import build_parser, engine_config_from_args

    body = {"metadata": {"name": "tiny", "namespace": "ml", "uid": "u"},
            "spec": {"model": {"name": "tiny", "uri": str(tiny_model_dir)},
                     # one GPU per node: TP 1 fills it, so a replica that needs two GPUs
                     # takes two pipeline stages on two nodes
                     "gpu": {"memoryGiB": 1, "perNode": 1, "maxPerReplica": 8},
                     "engine": {"maxModelLen": 512, "maxNumSeqs": 200, "dtype": "float32",
                                "gpuMemoryUtilization": 0.05}}}
    spec = parse_spec(body, ModelReader())
    sizing = plan(spec)
    assert (sizing.tensor_parallel_size, sizing.pipeline_parallel_size) == (1, 2)
    assert sizing.nodes_per_replica == 2
    config = engine_config_from_args(build_parser().parse_args(engine_args(spec, sizing)))
    assert config.pipeline_parallel_size == 2
    monkeypatch.setenv("KVSERVE_DEVICE_MEMORY", str(spec.gpu_memory_bytes))
    engine = LLMEngine.from_config(config)
    try:
        budget = engine.memory_budget
        assert budget.bytes_per_block * 2 == sizing.bytes_per_block  # a stage's layers
        # The operator estimates a stage's weights from the shapes (the larger stage, with the
        # embedding or, tied here, a copy of it as the lm_head); the engine counts what it
        # loaded. They agree to the block.
        assert budget.num_blocks == sizing.num_blocks > 0
        assert budget.max_concurrency == sizing.max_concurrency
    finally:
        engine.shutdown()

"""One checkpoint, three figures of its weight bytes: the operator's status.sizing.weightBytes
(from the safetensors headers), the engine's startup log line and the server's
`kvserve:model_weight_bytes` gauge (both from what the engine actually holds) agree within 5%."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_llama
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.operator.model_files import ModelReader
from kvserve.operator.sizing import plan
from kvserve.operator.spec import parse_spec
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory) -> Path:
    # Untied: on the CPU a tied lm_head is packed for oneDNN as a copy of the embedding.
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-untied",
                            tie_word_embeddings=False)


def test_status_log_and_metrics_agree_on_weight_bytes(untied_model, caplog) -> None:
    body = {"metadata": {"name": "tiny", "namespace": "ml"},
            "spec": {"model": {"name": "tiny", "uri": str(untied_model)}, "device": "cpu",
                     "resources": {"limits": {"memory": "1Gi"}}, "engine": {"dtype": "float32"}}}
    status = plan(parse_spec(body, ModelReader())).as_status()
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        engine = LLMEngine.from_config(EngineConfig(model=str(untied_model), dtype="float32",
                                                    kv_cache_memory=1 << 22))
    line = next(r.getMessage() for r in caplog.records if "model weights:" in r.getMessage())
    logged = int(re.search(r"model weights: (\d+) bytes resident", line).group(1))
    headers = int(re.search(r"checkpoint headers say (\d+) bytes", line).group(1))
    server = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()
    try:
        text = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    gauge = float(re.search(r'^kvserve:model_weight_bytes\{model_name="tiny"\} (\S+)$', text,
                            re.M).group(1))
    sized = status["weightBytes"]
    assert sized == headers > 0
    for figure in (logged, gauge):
        assert abs(figure - sized) <= 0.05 * sized, (figure, sized)

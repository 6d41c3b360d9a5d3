"""The model-server metrics protocol a GIE / llm-d endpoint picker scrapes from vLLM pods, pinned
on a real server: names, types, labels, and values that follow the engine's state."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import wait_for
from lora_checks import adapters, lora_base  # noqa: F401 - fixtures
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.lora_models import LoRAModulePath

NUM_BLOCKS = 40
LONG = {"max_tokens": 120, "temperature": 0, "extra_body": {"ignore_eos": True}}


def start(model_dir: Any, adapter: str | None = None, **engine_kw: Any) -> ServerThread:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=256, **engine_kw))
    lora = [LoRAModulePath("a0", adapter)] if adapter else []
    app = create_app(engine, ServerConfig(served_model_names=["tiny"], lora_modules=lora))
    srv = ServerThread(app).start()
    srv.app = app  # type: ignore[attr-defined]
    return srv


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    srv = start(tiny_model_dir, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=1)
    yield srv
    srv.stop()


def scrape(url: str) -> dict[str, Any]:
    """/metrics parsed by prometheus_client's text parser: {family name: family}."""
    text = httpx.get(url + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def gauge(families: dict[str, Any], name: str) -> float:
    family = families[name]
    assert family.type == "gauge", f"{name} is a {family.type}"
    (sample,) = family.samples
    assert sample.name == name and set(sample.labels) == {"model_name"}
    assert sample.labels["model_name"] == "tiny"
    return sample.value


def load(url: str) -> tuple[float, float, float]:
    m = scrape(url)
    return (gauge(m, "vllm:num_requests_running"), gauge(m, "vllm:num_requests_waiting"),
            gauge(m, "vllm:kv_cache_usage_perc"))


def test_cache_config_info_names_the_engines_blocks(server):
    (sample,) = scrape(server.url)["vllm:cache_config_info"].samples
    assert sample.name == "vllm:cache_config_info" and sample.value == 1
    assert sample.labels["block_size"] == "16"
    assert sample.labels["num_gpu_blocks"] == str(NUM_BLOCKS)
    engine = server.app.state.engine
    assert sample.labels["num_gpu_blocks"] == str(engine.memory_budget.num_blocks)


def test_running_waiting_and_cache_usage_follow_the_load(server):
    assert load(server.url) == (0, 0, 0)
    client = openai.Client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    streams = [client.completions.create(model="tiny", prompt=f"Story {i}", stream=True, **LONG)
               for i in range(2)]
    first = iter(streams[0])
    next(first)  # one runs (max_num_seqs=1), the other waits for it
    wait_for(lambda: load(server.url)[:2] == (1, 1), 30, "one running, one waiting")
    assert 0 < load(server.url)[2] <= 1
    for s in streams:
        s.close()
    wait_for(lambda: load(server.url) == (0, 0, 0), 30, "the load gone")


def test_lora_requests_info_is_a_timestamp_labelled_with_the_adapters(lora_base, adapters):
    t0 = time.time()
    srv = start(lora_base, enable_lora=True, max_loras=2, max_lora_rank=8,
                adapter=str(adapters[0]))
    try:
        def info() -> Any:
            (sample,) = scrape(srv.url)["vllm:lora_requests_info"].samples
            return sample

        wait_for(lambda: "vllm:lora_requests_info" in scrape(srv.url), 30, "the LoRA gauge")
        idle = info()
        assert idle.labels == {"max_lora": "2", "running_lora_adapters": "",
                               "waiting_lora_adapters": ""}
        assert t0 <= idle.value <= time.time()
        client = openai.Client(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model="a0", prompt="Hello", stream=True, **LONG)
        next(iter(stream))
        wait_for(lambda: info().labels["running_lora_adapters"] == "a0", 30, "a0 running")
        assert idle.value <= info().value <= time.time()
        stream.close()
    finally:
        srv.stop()

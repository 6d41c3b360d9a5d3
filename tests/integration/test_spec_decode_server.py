"""Speculative decoding's metrics through a real server (openai client, /metrics parsed by
prometheus_client): vLLM's spec_decode_* counters follow the engine's own figures."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "adaptive": False}


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", max_model_len=256, speculative_config=SPEC))
    srv = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()
    srv.engine = engine  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, position label) -> value of the spec_decode families."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name.startswith("vllm:spec_decode"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    assert s.labels["model_name"] == "tiny"
                    out[(s.name, s.labels.get("position", ""))] = s.value
    return out


def test_spec_decode_counters(server):
    client = openai.Client(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for prompt in ["a b a b a b a b", "the cat and the cat and the cat and"]:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=80, temperature=0,
                                  extra_body={"ignore_eos": True})
    m = samples(server.url)
    stats = server.engine.get_stats()
    drafts = m[("vllm:spec_decode_num_drafts_total", "")]
    drafted = m[("vllm:spec_decode_num_draft_tokens_total", "")]
    accepted = m[("vllm:spec_decode_num_accepted_tokens_total", "")]
    assert (drafts, drafted, accepted) == (stats.spec_decode_num_drafts,
                                           stats.spec_decode_num_draft_tokens,
                                           stats.spec_decode_num_accepted_tokens)
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    per_pos = [m[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
               for i in range(len(stats.spec_decode_accepted_per_pos))]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)

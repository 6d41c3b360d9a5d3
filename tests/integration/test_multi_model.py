"""Several models in one process over one KV pool, with real models and a real server process:
two tiny random models of different families and KV shapes (a Qwen3 with 4 layers x 2 KV heads
x 32 dims, a Llama with 2 x 2 x 16: a quarter of the page) answer greedy exactly as each served
alone; a burst on one model takes the pages the other just freed (KV manager page counts); the
server routes by `model`, lists both, labels metrics per model, 404s an unknown model, and
loads / unloads a model at runtime behind KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_llama, build_tiny_tokenizer, make_llm
from server_process import api_server_process

from kvserve import SamplingParams
from kvserve.engine.multi_model import MultiModelLLM

PROMPTS = [[5, 6, 7, 8, 9] * (i + 1) for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def build_tiny_qwen3(path: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tiny_tokenizer()
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("multi")
    return {"qwen": build_tiny_qwen3(base / "qwen"), "llama": build_tiny_llama(base / "llama")}


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_two_models_in_one_pool_answer_as_each_alone(models):
    together = MultiModelLLM({n: str(p) for n, p in models.items()}, dtype="float32",
                             device="cpu", kv_cache_memory=1 << 22)
    try:
        pool = together.models.shared.pool
        assert pool.page_bytes == 2 * 4 * 16 * 2 * 32 * 4  # the Qwen3 block is the page
        assert pool.waste("llama") == 0.75
        both = together.generate_many({"qwen": (PROMPTS, GREEDY), "llama": (PROMPTS, GREEDY)})
    finally:
        together.shutdown()
    for name, path in models.items():
        alone = make_llm(path)
        try:
            assert tokens(both[name]) == tokens(alone.generate(PROMPTS, GREEDY))
        finally:
            alone.shutdown()


def test_a_burst_on_one_model_takes_the_pages_the_other_freed(models):
    llm = MultiModelLLM({n: str(p) for n, p in models.items()}, num_pages=24, dtype="float32",
                        device="cpu")
    try:
        ms = llm.models
        qwen, llama = ms.engines["qwen"], ms.engines["llama"]
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i in range(4):  # 4 x (24 + 40 tokens) = 16 pages of 16 tokens
            qwen.add_request(f"q{i}", [10 + i] * 24, long)
        peak_q, used_by_q = 0, set()
        while qwen.has_unfinished_requests():
            ms.step()
            peak_q = max(peak_q, ms.held_pages("qwen"))
            used_by_q |= {b for s in qwen.scheduler.running for b in qwen.kv.block_ids(s)}
        assert peak_q == 16 and ms.held_pages("qwen") == 0
        for i in range(5):  # the burst: 5 x (32 + 40) tokens = 5 x 5 = 25 > 24 pages at peak
            llama.add_request(f"l{i}", [20 + i] * 32, long)
        peak_l, used_by_l = 0, set()
        while llama.has_unfinished_requests():
            ms.step()
            peak_l = max(peak_l, ms.held_pages("llama"))
            used_by_l |= {b for s in llama.scheduler.running for b in llama.kv.block_ids(s)}
        # more than a half split of the pool, on pages the other model held a moment before
        assert peak_l > 12 and len(used_by_l & used_by_q) >= 4
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    os.environ["KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING"] = "true"
    try:
        log = tmp_path_factory.mktemp("logs") / "multi.log"
        with api_server_process(models["qwen"], log, "--additional-model",
                                f"llama={models['llama']}") as (_, url):
            yield url
    finally:
        os.environ.pop("KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING", None)


def complete(url: str, model: str | None, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_the_server_routes_each_model_and_answers_as_each_alone(server, models):
    import openai

    client = openai.Client(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert sorted(m.id for m in client.models.list().data) == ["llama", "tiny"]
    alone = {}
    for name in models:
        llm = make_llm(models[name])
        try:
            alone[name] = llm.generate([PROMPTS[2]], GREEDY)[0].outputs[0].text
        finally:
            llm.shutdown()
    assert alone["qwen"] != alone["llama"]  # so each answer says which model ran
    for served, name in (("tiny", "qwen"), ("llama", "llama")):
        got = client.completions.create(model=served, prompt=PROMPTS[2], max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == alone[name] and got.model == served
    no_model = complete(server, None, PROMPTS[2]).json()  # the first model answers
    assert no_model["choices"][0]["text"] == alone["qwen"]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "llama" in err.value.body["message"]
    metrics = httpx.get(server + "/metrics").text
    for name in ("tiny", "llama"):
        assert f'vllm:num_requests_running{{model_name="{name}"}}' in metrics
        assert f'vllm:e2e_request_latency_seconds_count{{model_name="{name}"}}' in metrics


def test_models_load_and_unload_at_runtime(server, models, tmp_path):
    load = httpx.post(server + "/v1/load_model", timeout=120,
                      json={"model_name": "llama2", "model_path": str(models["llama"])})
    assert load.status_code == 200, load.text
    assert complete(server, "llama2", PROMPTS[0]).json()["choices"][0]["text"] == \
        complete(server, "llama", PROMPTS[0]).json()["choices"][0]["text"]
    assert httpx.post(server + "/v1/unload_model", json={"model_name": "llama2"},
                      timeout=60).status_code == 200
    assert "llama2" not in [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]]
    assert complete(server, "llama2", PROMPTS[0]).status_code == 404
    assert httpx.post(server + "/v1/unload_model", json={"model_name": "tiny"},
                      timeout=60).status_code == 400  # it sized the pool
    missing = httpx.post(server + "/v1/load_model", timeout=120,
                         json={"model_name": "x", "model_path": str(models["qwen"] / "nope")})
    assert missing.status_code == 400
    big = build_tiny_llama(tmp_path / "big", num_hidden_layers=10)  # 40 KiB blocks > 32 KiB
    refused = httpx.post(server + "/v1/load_model", timeout=120,
                         json={"model_name": "big", "model_path": str(big)})
    assert refused.status_code == 400 and "bytes per block" in refused.json()["error"]["message"]
    assert sorted(m["id"] for m in httpx.get(server + "/v1/models").json()["data"]) == \
        ["llama", "tiny"]

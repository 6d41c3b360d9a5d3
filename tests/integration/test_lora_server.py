"""LoRA adapters through a real uvicorn server and the real openai client: --lora-modules at
start, vLLM's runtime load/unload endpoints, `model: "<adapter>"` in completions, chat and
/v1/responses (answers equal to HF + peft merged), /v1/models with parents, the
vllm:lora_requests_info metric, and each bad adapter a 400 naming why (404 for unknown names)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from server_thread import ServerThread
from test_api_server import metrics, start_server
from transformers import AutoTokenizer

from conftest import build_tiny_llama
from kvserve.service.cli import build_serve_parser, engine_config_from_args, \
    server_config_from_args
from kvserve.service.server.lora_models import LoRAModulePath, lora_module
from lora_checks import adapters, build_adapter, lora_base, merged_model  # noqa: F401 - fixtures

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(lora_base, adapters) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        srv = start_server(lora_base, engine_kw={"enable_lora": True, "max_loras": 1,
                                                 "max_lora_rank": 8},
                           lora_modules=[LoRAModulePath("a0", str(adapters[0]))])
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> openai.Client:
    return openai.Client(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def hf_text(base, adapter, prompt: str, n: int) -> str:
    """HF + peft merged greedy continuation of `prompt` (the server's tokenization: BOS first)."""
    tok = AutoTokenizer.from_pretrained(base)
    ids = tok(prompt)["input_ids"]
    model = merged_model(base, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_models_lists_adapters_with_their_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a0"].parent == "tiny" and cards["tiny"].model_extra.get("parent") is None


def test_adapter_answers_equal_hf_peft_merged(client, lora_base, adapters):
    assert complete(client, "a0") == hf_text(lora_base, adapters[0], PROMPT, 6)
    assert complete(client, "tiny") == hf_text(lora_base, None, PROMPT, 6)
    chat = client.chat.completions.create(model="a0", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "a0" and chat.choices[0].message.content is not None
    resp = client.responses.create(model="a0", input="hi", max_output_tokens=4, temperature=0)
    assert resp.model == "a0"


def test_runtime_load_and_unload(server, client, lora_base, adapters):
    http = httpx.Client(base_url=server.url, timeout=60)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(adapters[1])})
    assert r.status_code == 200 and "added successfully" in r.text
    assert "a1" in {m.id for m in client.models.list().data}
    # max_loras=1: a0 and a1 take turns in the one slot
    assert complete(client, "a1") == hf_text(lora_base, adapters[1], PROMPT, 6)
    assert complete(client, "a0") == hf_text(lora_base, adapters[0], PROMPT, 6)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        complete(client, "a1")
    info = [k for k in metrics(server.url) if k.startswith("vllm:lora_requests_info")]
    assert info and "max_lora=1" in info[0]


def test_bad_adapters_are_400_naming_why(server, lora_base, adapters, tmp_path):
    http = httpx.Client(base_url=server.url, timeout=60)
    other = build_tiny_llama(tmp_path / "other", hidden_size=32)
    cases = {
        "max_lora_rank": build_adapter(lora_base, tmp_path / "big", seed=1, r=16),
        "another base model": build_adapter(other, tmp_path / "other-lora", seed=1),
        "supported target modules": build_adapter(lora_base, tmp_path / "emb", seed=1,
                                                  targets=["q_proj", "embed_tokens"]),
        "not a LoRA adapter": lora_base,
        "already been loaded": adapters[0],
    }
    for i, (words, path) in enumerate(cases.items()):
        name = "a0" if words == "already been loaded" else f"bad{i}"
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, (words, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/completions", json={"model": "never-loaded", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_runtime_routes_need_the_environment_switch(lora_base):
    srv = start_server(lora_base, engine_kw={"enable_lora": True})
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x",
                                                                 "lora_path": "/tmp"})
        assert r.status_code == 404
    finally:
        srv.stop()


def test_lora_flags():
    assert lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert lora_module('{"name": "s", "path": "/p", "base_model_name": "m"}') == \
        LoRAModulePath("s", "/p", "m")
    with pytest.raises(argparse.ArgumentTypeError):
        lora_module("no-equals-sign")
    parser = build_serve_parser()
    args = parser.parse_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
                              "--max-cpu-loras", "8", "--lora-modules", "a=/x", "b=/y"])
    cfg = engine_config_from_args(args)
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras) == \
        (True, 4, 32, 8)
    assert [m.name for m in server_config_from_args(args).lora_modules] == ["a", "b"]
    with pytest.raises(Exception, match="needs --enable-lora"):
        server_config_from_args(parser.parse_args(["--lora-modules", "a=/x"]))

"""vLLM's token-level routes on a real server (tiny random Llama): /inference/v1/generate whole
and streamed, /v1/chat/completions/batch, /tokenize's vLLM fields; HF transformers is the
reference for the generated tokens and their logprobs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch
from family_checks import hf_logprobs
from server_thread import ServerThread
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

MAX_MODEL_LEN = 128
PROMPT = [5, 17, 42, 99, 7, 64, 3, 120]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=2 << 20))
    srv = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def generate(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/inference/v1/generate", json=body, timeout=60, **kw)


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def test_generate_gives_hf_greedy_tokens_and_logprobs_in_vllm_shape(server, hf):
    r = generate(server.url, {"token_ids": PROMPT, "request_id": "abc", "model": "tiny",
                              "sampling_params": {**GREEDY, "logprobs": 2}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"request_id", "choices", "prompt_logprobs", "kv_transfer_params"}
    assert body["request_id"] == "generate-tokens-abc"
    (choice,) = body["choices"]
    assert set(choice) == {"index", "logprobs", "finish_reason", "token_ids", "routed_experts"}
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    ref = hf_logprobs(hf, PROMPT, choice["token_ids"])
    assert choice["token_ids"] == ref.argmax(-1).tolist()
    content = choice["logprobs"]["content"]
    for i, (tid, entry) in enumerate(zip(choice["token_ids"], content)):
        assert entry["token"] == f"token_id:{tid}" and entry["bytes"] is None
        assert entry["logprob"] == pytest.approx(ref[i, tid].item(), abs=2e-4)
        # vLLM's order: the sampled token first, max(k, 1) entries in all
        tops = entry["top_logprobs"]
        assert [t["token"] for t in tops][0] == f"token_id:{tid}" and len(tops) == 2
        second = int(tops[1]["token"].split(":")[1])
        assert second == ref[i].topk(2).indices[1].item()


def test_generate_streams_the_same_tokens_then_usage_and_done(server):
    whole = generate(server.url, {"token_ids": PROMPT, "sampling_params": GREEDY}).json()
    r = generate(server.url, {"token_ids": PROMPT, "stream": True, "sampling_params": GREEDY,
                              "stream_options": {"include_usage": True}},
                 headers={"X-Request-Id": "from-header"})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage == {"request_id": "generate-tokens-from-header", "choices": [],
                     "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 6,
                               "total_tokens": len(PROMPT) + 6}}
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert tokens == whole["choices"][0]["token_ids"]
    assert all(c["choices"][0]["token_ids"] for c in chunks)  # no empty chunks (vLLM's rule)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert set(chunks[0]) == {"request_id", "choices", "usage"} and chunks[0]["usage"] is None


def test_generate_without_max_tokens_fills_the_context(server):
    prompt = [7] * (MAX_MODEL_LEN - 3)
    r = generate(server.url, {"token_ids": prompt,
                              "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("body, param", [
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1]}, "sampling_params"),  # required, as in vLLM
    ({"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {}}}, "features"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": MAX_MODEL_LEN}},
     "sampling_params.max_tokens"),
    ({"token_ids": [1], "sampling_params": {"use_beam_search": True}},
     "sampling_params.use_beam_search"),
])
def test_generate_refuses_what_it_cannot_do_naming_the_field(server, body, param):
    r = generate(server.url, body)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"] or r.json()["error"]["param"] == param


def chat(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", "max_tokens": 5, "temperature": 0,
                                        "ignore_eos": True, **body}, timeout=60)


CONVERSATIONS = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a colour."}]]


def test_chat_batch_answers_each_conversation_as_chat_completions_would(server):
    r = chat(server.url, "/v1/chat/completions/batch", {"messages": CONVERSATIONS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    singles = [chat(server.url, "/v1/chat/completions", {"messages": m}).json()
               for m in CONVERSATIONS]
    for choice, single in zip(body["choices"], singles):
        assert choice["message"]["content"] == single["choices"][0]["message"]["content"]
        assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["completion_tokens"] == 10


def test_chat_batch_returns_each_choices_token_ids_when_asked(server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = chat(server.url, "/v1/chat/completions/batch", {"messages": CONVERSATIONS,
                                                        "return_token_ids": True})
    for choice in r.json()["choices"]:
        assert len(choice["token_ids"]) == 5
        assert tok.decode(choice["token_ids"]) == choice["message"]["content"]
    plain = chat(server.url, "/v1/chat/completions/batch", {"messages": CONVERSATIONS}).json()
    assert all("token_ids" not in c for c in plain["choices"])


def test_chat_batch_applies_the_shared_constraint_to_every_conversation(server):
    r = chat(server.url, "/v1/chat/completions/batch", {
        "messages": CONVERSATIONS, "structured_outputs": {"regex": "(yes|no)"},
        "ignore_eos": False})
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] in (
        [a, b] for a in ("yes", "no") for b in ("yes", "no"))


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [[]]}, "messages"), ({"messages": []}, "messages"),
    ({"continuation": {"index": 0, "token_ids": [5]}}, "continuation"),
])
def test_chat_batch_refusals_name_the_field(server, extra, param):
    r = chat(server.url, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, **extra})
    assert r.status_code == 400, r.text
    assert param in json.dumps(r.json()["error"])


def test_tokenize_returns_token_strings_and_takes_the_chat_fields(server, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = httpx.post(server.url + "/tokenize", json={"prompt": "The quick fox",
                                                   "return_token_strs": True})
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    msgs = CONVERSATIONS[0]
    plain = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert plain["token_strs"] is None
    assert plain["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
    refused = httpx.post(server.url + "/tokenize", json={"messages": msgs,
                                                         "continue_final_message": True})
    assert refused.status_code == 400 and "continue_final_message" in refused.text


def test_reset_prefix_cache_is_a_dev_mode_route(server):
    # vLLM exposes it only with VLLM_SERVER_DEV_MODE=1 (tests/integration/test_kv_events_reset.py)
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 404

"""Continuations through a real server and the openai client (tiny fp32 Llama): a request that
sends the token ids a stream delivered before some chunk, as `continuation`, answers exactly
what that stream sent after it (text, token ids, usage), streamed or not, chat and completions,
greedy and seeded; `return_token_ids` lists, in every chunk, the ids of that chunk's text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
CHAT = [{"role": "user", "content": "Explain how the KV cache works"}]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.8, "seed": 11}


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), max_model_len=256, kv_cache_memory=4 << 20, dtype="float32"))
    srv = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()
    yield srv
    srv.stop()


def body(chat: bool, sampling: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The request's keywords: the prompt, 20 tokens, no EOS, sampling, vLLM/kvserve extras."""
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 20, **sampling}
    kw["messages" if chat else "prompt"] = CHAT if chat else PROMPT
    kw["extra_body"] = {"ignore_eos": True, "return_token_ids": True, **extra}
    return kw


def stream(client, chat: bool, sampling: dict, **extra: Any) -> tuple[list, dict]:
    """(text, token ids) of each chunk of a stream, and its usage (with the prompt's ids the
    first chunk carried: the chat chunk's, or the completion choice's)."""
    api = client.chat.completions if chat else client.completions
    chunks, usage, prompt_ids = [], None, None
    for ch in api.create(stream=True, stream_options={"include_usage": True},
                         **body(chat, sampling, **extra)):
        usage = ch.usage or usage
        if prompt_ids is None:
            prompt_ids = getattr(ch if chat else ch.choices[0], "prompt_token_ids", None)
        for c in ch.choices:
            text = (c.delta.content or "") if chat else c.text
            chunks.append((text, list(getattr(c, "token_ids", None) or []), c.index))
    assert prompt_ids is not None and len(prompt_ids) == usage.prompt_tokens
    return chunks, usage.model_dump()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_continuation_streams_what_the_stream_sent_after_the_break(client, chat, sampling):
    chunks, usage = stream(client, chat, sampling)
    text = "".join(t for t, _, _ in chunks)
    ids = [i for _, tok, _ in chunks for i in tok]
    assert len(ids) == 20 == usage["completion_tokens"]
    for cut in (3, len(chunks) // 2):
        sent_ids = [i for _, tok, _ in chunks[:cut] for i in tok]
        sent_text = "".join(t for t, _, _ in chunks[:cut])
        rest, rest_usage = stream(client, chat, sampling,
                                  continuation={"token_ids": sent_ids})
        assert sent_text + "".join(t for t, _, _ in rest) == text
        assert sent_ids + [i for _, tok, _ in rest for i in tok] == ids
        assert rest_usage["prompt_tokens"] == usage["prompt_tokens"]
        assert rest_usage["completion_tokens"] == 20  # the continuation's tokens count


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_continuation_answers_the_rest(client, chat):
    api = client.chat.completions if chat else client.completions
    full = api.create(**body(chat, SEEDED))
    ids = full.choices[0].token_ids
    whole = full.choices[0].message.content if chat else full.choices[0].text
    prompt_ids = full.prompt_token_ids if chat else full.choices[0].prompt_token_ids
    assert len(ids) == 20 and len(prompt_ids) == full.usage.prompt_tokens
    chunks, _ = stream(client, chat, SEEDED)
    cut = 4
    sent_ids = [i for _, tok, _ in chunks[:cut] for i in tok]
    sent_text = "".join(t for t, _, _ in chunks[:cut])
    rest = api.create(**body(chat, SEEDED, continuation={"token_ids": sent_ids}))
    text = rest.choices[0].message.content if chat else rest.choices[0].text
    assert sent_text + text == whole
    assert rest.choices[0].token_ids == ids[len(sent_ids):]
    assert rest.usage.completion_tokens == 20 and rest.usage.prompt_tokens == len(prompt_ids)


def test_token_ids_stay_with_text_held_for_a_stop_string(client):
    """A stop string that never comes holds the last characters back; the tokens of held text
    are held with it, so a continuation from any chunk still joins exactly."""
    stop = ["zzzzz"]  # 4 characters held
    chunks, _ = stream(client, False, GREEDY, stop=stop)
    text = "".join(t for t, _, _ in chunks)
    assert len(chunks) >= 3
    for cut in range(1, len(chunks)):  # any break before the last chunk
        sent_ids = [i for _, tok, _ in chunks[:cut] for i in tok]
        sent_text = "".join(t for t, _, _ in chunks[:cut])
        rest, _ = stream(client, False, GREEDY, stop=stop, continuation={"token_ids": sent_ids})
        assert sent_text + "".join(t for t, _, _ in rest) == text


def test_continuation_index_max_tokens_and_refusals(client):
    full = client.completions.create(**body(False, GREEDY))
    ids = full.choices[0].token_ids
    rest = client.completions.create(**body(False, GREEDY, continuation={
        "token_ids": ids[:5], "index": 1}))
    assert rest.choices[0].index == 1 and rest.choices[0].token_ids == ids[5:]
    scored = client.completions.create(**{**body(False, GREEDY, continuation={
        "token_ids": ids[:5]}), "logprobs": 1})
    lp = scored.choices[0].logprobs  # the new tokens' only, offsets from the answer's start
    assert len(lp.tokens) == 15 and lp.text_offset[0] == 0
    # already at max_tokens: it ends at once with what the run said at its end (the bytes of
    # a character its last tokens left incomplete, which a stream holds until then)
    chunks, _ = stream(client, False, GREEDY)
    sent_ids = chunks[0][1]
    short = body(False, GREEDY, continuation={"token_ids": sent_ids})
    short["max_tokens"] = len(sent_ids)
    done = client.completions.create(**short)
    assert done.choices[0].finish_reason == "length" and done.choices[0].token_ids == []
    assert done.usage.completion_tokens == len(sent_ids)
    alone = client.completions.create(**{**body(False, GREEDY), "max_tokens": len(sent_ids)})
    assert chunks[0][0] + done.choices[0].text == alone.choices[0].text
    for bad in ({"n": 2}, {"echo": True}, {"prompt": [PROMPT, PROMPT]}):
        kw = body(False, GREEDY, continuation={"token_ids": ids[:3]})
        kw.update(bad)
        with pytest.raises(openai.BadRequestError, match="continuation"):
            client.completions.create(**kw)


def test_a_responses_continuation_answers_the_rest(client):
    """/v1/responses runs as a chat completion: the same continuation (EOS on, as there)."""
    chunks, usage = stream(client, True, GREEDY, ignore_eos=False)
    text = "".join(t for t, _, _ in chunks)
    sent_ids = [i for _, tok, _ in chunks[:3] for i in tok]
    sent_text = "".join(t for t, _, _ in chunks[:3])
    rest = client.responses.create(model="tiny", input=CHAT[0]["content"], max_output_tokens=20,
                                   temperature=0.0,
                                   extra_body={"continuation": {"token_ids": sent_ids}})
    assert sent_text + rest.output_text == text
    assert rest.usage.output_tokens == usage["completion_tokens"]


def test_responses_text_deltas_carry_their_token_ids(server):
    """/v1/responses streamed with return_token_ids: each text delta event names its tokens."""
    req = {"model": "tiny", "input": CHAT[0]["content"], "max_output_tokens": 12,
           "temperature": 0.0, "stream": True, "return_token_ids": True}
    ids, text, usage = [], "", None
    with httpx.stream("POST", server.url + "/v1/responses", json=req, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                ids += event["token_ids"]
                text += event["delta"]
            elif event["type"] == "response.completed":
                usage = event["response"]["usage"]
    assert text and len(ids) <= usage["output_tokens"]
    assert len(ids) >= usage["output_tokens"] - 1  # all but an EOS whose text is empty

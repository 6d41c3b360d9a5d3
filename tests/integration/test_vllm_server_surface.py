"""vLLM's server surface through the real server and the real openai client, on the tiny random
Llama: several served names, the tool-call parsers and streamed calls, a server chat template,
`reasoning` on messages, `response_format: structural_tag`, and /v1/responses (text, streaming,
function tools) with `client.responses.create`. A random model writes calls only when a regex
makes it, so the parsers are checked on text the grammar forces."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from conftest import build_tiny_llama
from test_structured_server import SCHEMAS, TIME, WEATHER

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from server_thread import ServerThread

CHAT = [{"role": "user", "content": "Weather in Paris?"}]
TWO_CALLS = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": '
             r'"C"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": '
             r'"CET"\}\}\n</tool_call>')
MISTRAL_CALL = r'\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\]'


@pytest.fixture(scope="module")
def tiny_2k(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-2k",
                            max_position_embeddings=2048)


def _server(model, **config) -> ServerThread:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model), max_model_len=2048, kv_cache_memory=16 << 20, dtype="float32"))
    return ServerThread(create_app(engine, ServerConfig(**config))).start()


@pytest.fixture(scope="module")
def server(tiny_2k) -> Iterator[ServerThread]:
    srv = _server(tiny_2k, served_model_names=["tiny", "tiny-alias"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mistral(tiny_2k) -> Iterator[openai.OpenAI]:
    """--tool-call-parser mistral with a --chat-template of our own (which knows no tools)."""
    srv = _server(tiny_2k, served_model_names=["tiny"], tool_call_parser="mistral",
                  chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                                "{% endfor %}<assistant>")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.stop()


def chat(client, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", CHAT)
    return client.chat.completions.create(model="tiny", **kw)


def test_every_served_name_is_listed_and_answers(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    out = client.chat.completions.create(model="tiny-alias", messages=CHAT, max_tokens=2)
    assert out.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT, max_tokens=2)


def test_reasoning_on_earlier_messages_is_accepted(client, server):
    history = [*CHAT, {"role": "assistant", "content": "Sunny.", "reasoning": None,
                       "reasoning_content": "look it up"}, {"role": "user", "content": "Sure?"}]
    with_reasoning = httpx.post(server.url + "/tokenize", json={"messages": history}).json()
    plain = [{k: v for k, v in m.items() if "reasoning" not in k} for m in history]
    assert with_reasoning == httpx.post(server.url + "/tokenize", json={"messages": plain}).json()
    assert chat(client, messages=history, max_tokens=2).choices[0].finish_reason == "length"


def test_streamed_auto_calls_arrive_each_as_it_closes(client):
    kw = dict(tools=[WEATHER, TIME], tool_choice="auto", temperature=1.0, seed=1,
              extra_body={"guided_regex": TWO_CALLS})
    whole = chat(client, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather", "get_time"]
    chunks = list(chat(client, stream=True, **kw))
    seen = [(i, d) for i, ch in enumerate(chunks) for c in ch.choices
            for d in c.delta.tool_calls or []]
    assert [(d.index, d.function.name) for _, d in seen] == [(0, "get_weather"), (1, "get_time")]
    # how many tokens one chunk holds depends on the engine's pace; that each call goes out as
    # soon as it closes is checked token by token in tests/unit/service/test_tool_calls.py
    assert seen[0][0] <= seen[1][0]
    assert [json.loads(d.function.arguments) for _, d in seen] == \
        [json.loads(c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_mistral_parser_and_server_chat_template(mistral, server):
    kw = dict(tools=[TIME], tool_choice="auto", temperature=1.0, seed=2, max_tokens=200,
              extra_body={"guided_regex": "Ok" + MISTRAL_CALL})
    out = mistral.chat.completions.create(model="tiny", messages=CHAT, **kw).choices[0]
    assert out.message.content == "Ok" and out.finish_reason == "tool_calls"
    (call,) = out.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                        {"zone": "UTC"})
    ids = httpx.post(str(mistral.base_url).replace("/v1/", "/tokenize"),
                     json={"messages": CHAT}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "<user>Weather in Paris?<assistant>"  # --chat-template, not the tokenizer's


def test_structural_tag_response_format(client):
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True,
        "stop_after_first": True, "tags": [{
            "begin": "<function=get_weather>", "end": "</function>", "content": {
                "type": "json_schema", "json_schema": SCHEMAS["get_weather"]}}]}}
    text = chat(client, temperature=1.0, seed=3, max_tokens=400,
                response_format=tag).choices[0].message.content
    body = text.split("<function=get_weather>", 1)[1].split("</function>", 1)[0]
    jsonschema.validate(json.loads(body), SCHEMAS["get_weather"])
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [{
        "begin": "<function=get_weather>", "schema": SCHEMAS["get_weather"],
        "end": "</function>"}]}
    out = chat(client, temperature=1.0, seed=4, max_tokens=50, response_format=legacy)
    assert out.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, response_format={"type": "structural_tag", "structures": []})
    assert info.value.body["param"] == "response_format"


def test_responses_text_whole_and_streamed(client):
    out = client.responses.create(model="tiny", input="Hello", instructions="Be brief.",
                                  max_output_tokens=8, temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output_text
    assert out.usage.output_tokens == 8 and out.usage.input_tokens > 0
    same = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert out.output_text == same.choices[0].message.content
    events = list(client.responses.create(model="tiny", input="Hello", instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == out.output_text == events[-1].response.output_text


def test_responses_function_tools_and_their_results(client):
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    out = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools,
                                  tool_choice="required", temperature=1.0, max_output_tokens=300)
    calls = [o for o in out.output if o.type == "function_call"]
    assert calls  # (the random model may go on listing calls until max_output_tokens)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    stream = list(client.responses.create(
        model="tiny", input="Weather?", tools=tools, tool_choice={"type": "function",
                                                                  "name": "get_time"},
        temperature=1.0, max_output_tokens=300, stream=True))
    done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert [i.name for i in done] == ["get_time"]
    args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
    assert args == done[0].arguments and json.loads(args)
    follow = client.responses.create(model="tiny", tools=tools, max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}])
    assert follow.usage.input_tokens > out.usage.input_tokens - 1


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
])
def test_responses_refusals_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param

"""Tool plans, the Hermes prompt and parser, streamed tool calls, and request -> constraint."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sample.tokenizer import render_chat
from kvserve.service.chat_request import ChatCompletionRequest
from kvserve.service.request_models import CompletionRequest
from kvserve.service.tool_calls import (ToolCallStream, finish_reason, parse_output,
                                        template_messages, tool_plan)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_choice_modes_and_their_constraints():
    assert tool_plan(None, None) is None and tool_plan([WEATHER], "none") is None
    assert tool_plan([WEATHER], None).mode == "auto"  # OpenAI's default with tools
    assert tool_plan([WEATHER], "auto").constraint() is None
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint().schema() == WEATHER["function"]["parameters"]
    assert tool_plan([TIME], {"type": "function", "function": {"name": "get_time"}}
                     ).constraint().json_object
    required = tool_plan([WEATHER, TIME], "required").constraint().schema()
    assert required["minItems"] == 1 and len(required["items"]["anyOf"]) == 2


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", "tools.0"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "tools.0"),
    ("not a list", "auto", "tools"),
])
def test_bad_tools_are_400s(tools, choice, param):
    with pytest.raises(InvalidRequestError) as info:
        tool_plan(tools, choice)
    assert info.value.param == param


def test_hermes_parser_auto_required_named():
    auto = tool_plan([WEATHER], "auto")
    content, calls = parse_output(auto, "Let me look.\n" + CALL + CALL)
    assert content == "Let me look." and len(calls) == 2
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert parse_output(auto, "just text") == ("just text", [])
    broken = "<tool_call>{not json</tool_call>"
    assert parse_output(auto, broken) == (broken, [])  # no valid call: it stays text
    required = tool_plan([WEATHER], "required")
    assert parse_output(required, '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
                        )[1][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert parse_output(required, '[{"name": "get_we') == ('[{"name": "get_we', [])
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert parse_output(named, '{"city": "Oslo"}')[1][0]["function"]["arguments"] == \
        '{"city": "Oslo"}'
    assert finish_reason(calls, "stop") == "tool_calls"
    assert finish_reason(calls, "length") == "length" and finish_reason([], "stop") == "stop"


def test_auto_stream_holds_back_a_possible_call():
    stream = ToolCallStream(tool_plan([WEATHER], "auto"))
    sent = [stream.feed(piece) for piece in ["Sure", ". <tool", "_call>\n{\"name\": ",
                                             '"get_weather", "arguments": {}}\n</tool_call>']]
    assert sent[:3] == [{"content": "Sure"}, {"content": "."}, None]  # " " waits, then is cut
    # the call goes out as soon as its JSON object closes, not at the end
    assert sent[3]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert stream.finish() == [] and len(stream.calls) == 1
    plain = ToolCallStream(tool_plan([WEATHER], "auto"))
    assert plain.feed("a <tool") == {"content": "a"}
    assert plain.finish() == [{"content": " <tool"}]  # it never became a call


def test_named_stream_sends_arguments_as_they_come():
    stream = ToolCallStream(tool_plan([WEATHER], {"type": "function",
                                                  "function": {"name": "get_weather"}}))
    first, second = stream.feed('{"city": '), stream.feed('"Oslo"}')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert first["tool_calls"][0]["id"].startswith("call_")
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    assert stream.finish() == [] and len(stream.calls) == 1


def test_history_with_calls_and_results_renders_through_a_plain_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}]
    messages, tools = template_messages(history, tool_plan([WEATHER], "auto"), tok.chat_template)
    assert tools is None  # SmolLM2's template knows no tools: Hermes text instead
    text = render_chat(tok, messages)
    assert "<tools>" in text and '"get_weather"' in text
    assert CALL.replace("\n", "") in text.replace("\n", "")
    assert "<|im_start|>tool\n<tool_response>\n18 C, sunny\n</tool_response>" in text
    native = "{% for m in messages %}{{ m.role }}{% endfor %}{{ tools | tojson }}"
    messages, tools = template_messages(history, tool_plan([WEATHER], "auto"), native)
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}


def test_request_fields_to_constraints():
    def chat(**kw):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)
        req.check()
        return req.sampling_params(8, None).structured_outputs

    assert chat() is None and chat(response_format={"type": "text"}) is None
    assert chat(response_format={"type": "json_object"}).json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema}}).json == schema
    assert chat(structured_outputs={"regex": "a+"}).regex == "a+"
    assert chat(tools=[WEATHER], tool_choice="required").json["type"] == "array"
    comp = CompletionRequest(prompt="x", guided_choice=["a", "b"])
    comp.check()
    assert comp.sampling_params(8, None).structured_outputs.choice == ["a", "b"]


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format"),
    (dict(guided_json={"type": "object"}, guided_regex="a"), "structured_outputs"),
    (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex"),
    (dict(structured_outputs={"regexp": "a"}), "structured_outputs"),
    (dict(guided_json="{not json"), "guided_json"),
    (dict(guided_regex="a", guided_decoding_backend="outlines"), "guided_decoding_backend"),
    (dict(tools=[WEATHER], tool_choice="required", guided_regex="a"), "tool_choice"),
])
def test_bad_request_fields_are_400s(kw, param):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)
    with pytest.raises(InvalidRequestError) as info:
        req.check()
    assert info.value.param == param, str(info.value)
    json.dumps(str(info.value))


@pytest.mark.parametrize("parser, text", [
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}'),
    ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}'),
    ("hermes", CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
])
def test_each_parser_reads_its_format_whole_and_streamed(parser, text):
    plan = tool_plan([WEATHER, TIME], "auto", parser)
    content, calls = parse_output(plan, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert content == ("Sure." if parser == "mistral" else None)
    stream = ToolCallStream(plan)
    sent = [stream.feed(ch) for ch in text]  # one character at a time
    # the first call goes out as soon as its object closes, long before the text ends
    first = next(i for i, d in enumerate(sent) if d and "tool_calls" in d)
    assert first == text.index('"Paris"}}') + len('"Paris"}}') - 1
    assert sent[first]["tool_calls"][0]["index"] == 0
    streamed = [c for d in sent if d for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in streamed] == ["get_weather", "get_time"]
    assert stream.finish() == [] and [c["index"] for c in streamed] == [0, 1]
    said = "".join(d.get("content", "") for d in sent if d)
    assert said == ("Sure." if parser == "mistral" else "")


def test_required_stream_sends_each_call_of_the_list_as_it_closes():
    stream = ToolCallStream(tool_plan([WEATHER, TIME], "required"))
    text = '[{"name": "get_weather", "arguments": {"city": "a}\\"{"}}, {"name": "get_time", ' \
           '"arguments": {}}]'
    sent = [stream.feed(ch) for ch in text]
    got = [(i, c["function"]) for i, d in enumerate(sent) if d for c in d["tool_calls"]]
    assert got == [(text.index("}}") + 1, {"name": "get_weather",
                                            "arguments": '{"city": "a}\\"{"}'}),
                   (len(text) - 2, {"name": "get_time", "arguments": "{}"})]


# a conversation with one earlier call and its result, as a follow-up request sends it
CALL_HISTORY = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "c"}]


def test_parser_formats_in_a_template_without_tools():
    messages, tools = template_messages(CALL_HISTORY, tool_plan([WEATHER], "auto", "mistral"), "")
    assert tools is None and "[TOOL_CALLS]" in messages[0]["content"]
    assert messages[2]["content"] == \
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert messages[3]["content"] == "18 C"
    messages, _ = template_messages(CALL_HISTORY, tool_plan([WEATHER], "auto", "llama3_json"), "")
    assert messages[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'


XLAM_CALLS = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
             '{"name": "get_time", "arguments": {}}]'


@pytest.mark.parametrize("text, content", [
    (XLAM_CALLS, None),  # xLAM-2's own form: the bare list
    ("\n " + XLAM_CALLS, None),
    ("I will check.\n```json\n" + XLAM_CALLS + "\n```", "I will check."),
    ("I will check.```" + XLAM_CALLS + "```", "I will check."),
    ("Sure.[TOOL_CALLS]" + XLAM_CALLS, "Sure."),
    ("Sure.\n<tool_call>" + XLAM_CALLS + "</tool_call>", "Sure."),
    ("<think>a [b] `c`</think>\n" + XLAM_CALLS, "<think>a [b] `c`</think>"),
])
def test_xlam_reads_each_form_whole_and_streamed_cut_anywhere(text, content):
    plan = tool_plan([WEATHER, TIME], "auto", "xlam")
    whole_content, calls = parse_output(plan, text)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]

    def streamed(pieces):
        stream = ToolCallStream(plan)
        deltas = [d for d in (stream.feed(p) for p in pieces) if d] + stream.finish()
        said = "".join(d.get("content", "") for d in deltas)
        sent = [c for d in deltas for c in d.get("tool_calls", [])]
        return said, [(c["index"], c["function"]["name"], c["function"]["arguments"])
                      for c in sent]

    want = (content or "", [(i, c["function"]["name"], c["function"]["arguments"])
                            for i, c in enumerate(calls)])
    for cut in range(len(text) + 1):  # two deltas, cut at every character
        assert streamed([text[:cut], text[cut:]]) == want, cut
    assert streamed(list(text)) == want  # one character at a time
    # the first call goes out as soon as its object closes
    stream = ToolCallStream(plan)
    first = next(i for i, ch in enumerate(text) if (stream.feed(ch) or {}).get("tool_calls"))
    assert first == text.index('"Paris"}}') + len('"Paris"}}') - 1


@pytest.mark.parametrize("text", [
    "The answer is [1, 2] and `x`.",  # a list mid-text, a backtick: no call
    "```python\nprint([1])\n```",  # a fence that is no JSON list
    "[1, 2, 3]",  # a bare list of no calls
    "<tool_call>not json</tool_call>",
    '```json\n[{"name": "get_weather", "argu',  # cut short
])
def test_xlam_leaves_text_without_calls_as_content(text):
    plan = tool_plan([WEATHER], "auto", "xlam")
    assert parse_output(plan, text) == (text, [])
    stream = ToolCallStream(plan)
    deltas = [d for d in (stream.feed(ch) for ch in text) if d] + stream.finish()
    assert "".join(d["content"] for d in deltas) == text
    assert not any("tool_calls" in d for d in deltas)


def test_xlam_history_renders_as_a_json_list():
    messages, tools = template_messages(CALL_HISTORY, tool_plan([WEATHER], "auto", "xlam"), "")
    assert tools is None and '"arguments": <args-dict>' in messages[0]["content"]
    assert messages[2]["content"] == '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert messages[3]["content"] == "18 C"
    # a follow-up without tools still renders the earlier calls in the server's format
    messages, _ = template_messages(CALL_HISTORY, None, "", "xlam")
    assert messages[1]["content"] == '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def test_text_and_a_call_in_one_delta_go_out_as_two_chunks():
    from kvserve.service.server.chat import _tool_chunks
    from kvserve.service.server.stream_deltas import Delta

    stream = ToolCallStream(tool_plan([WEATHER, TIME], "auto", "xlam"))
    text = "I will look.\n```json\n" + XLAM_CALLS  # the engine's output came in one piece
    pieces = _tool_chunks(0, stream, Delta(text, [], None, "stop", None, 0), None)
    deltas = [p.delta.model_dump(exclude_none=True) for p in pieces]
    assert deltas[0] == {"content": "I will look."}
    assert [c["function"]["name"] for c in deltas[1]["tool_calls"]] == ["get_weather", "get_time"]
    assert pieces[-1].finish_reason == "tool_calls" and len(pieces) == 3

"""`--reasoning-parser` through the real server and the real openai client, on the tiny random
Llama: a regex makes the model write think tags (a random model writes them only when forced), and
the answer must come back split, whole and streamed, with tool calls read from the content only."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from conftest import build_tiny_llama
from test_structured_server import TIME, WEATHER

from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import ConfigError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from server_thread import ServerThread

CHAT = [{"role": "user", "content": "9.11 and 9.8, which is greater?"}]
THOUGHT = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n\n[A-Z][a-z]{2,6}( [a-z]{2,6}){1,3}\."
# a call written inside the reasoning is thought, not called: only the content's call counts
CALL_IN_BOTH = (r'<think>try <tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}'
                r'</tool_call></think>\n<tool_call>\n\{"name": "get_weather", "arguments": '
                r'\{"city": "Oslo", "unit": "C"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-2k",
                            max_position_embeddings=2048)


def _client(model, **config) -> tuple[ServerThread, openai.OpenAI]:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model), max_model_len=2048, kv_cache_memory=16 << 20, dtype="float32"))
    srv = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"], **config)))
    srv.start()
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def r1(engine_model) -> Iterator[openai.OpenAI]:
    srv, client = _client(engine_model, reasoning_parser="deepseek_r1")
    yield client
    srv.stop()


def chat(client, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", CHAT)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model="tiny", **kw)


def streamed(client, **kw) -> tuple[str, str, list]:
    """(reasoning, content, chunks) of a streamed answer, the deltas joined."""
    chunks = list(chat(client, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), chunks


def test_answer_is_split_into_reasoning_and_content(r1):
    msg = chat(r1, seed=1, extra_body={"guided_regex": THOUGHT}).choices[0].message
    assert msg.reasoning_content and msg.reasoning == msg.reasoning_content
    assert "<think>" not in msg.reasoning_content and "</think>" not in msg.reasoning_content
    assert msg.content.startswith("\n\n") and msg.content.endswith(".")
    assert "think>" not in msg.content
    # the streamed deltas join to the same split; reasoning chunks come before content ones
    reasoning, content, chunks = streamed(r1, seed=1, extra_body={"guided_regex": THOUGHT})
    assert (reasoning, content) == (msg.reasoning_content, msg.content)
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c")
             for c in chunks[1:] if c.choices and (c.choices[0].delta.content
                                                   or getattr(c.choices[0].delta,
                                                              "reasoning_content", None))]
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds
    for c in chunks:  # content chunks carry no reasoning keys (clients test hasattr)
        if c.choices and c.choices[0].delta.content:
            assert "reasoning_content" not in c.choices[0].delta.model_dump(exclude_unset=True)


def test_unclosed_reasoning_is_all_reasoning(r1):
    out = chat(r1, max_tokens=6).choices[0]
    assert out.finish_reason == "length"
    assert out.message.reasoning_content and out.message.content is None


def test_tool_calls_are_read_from_the_content_only(r1):
    kw = dict(tools=[WEATHER, TIME], seed=2, extra_body={"guided_regex": CALL_IN_BOTH})
    out = chat(r1, **kw).choices[0]
    assert out.finish_reason == "tool_calls"
    assert '"get_time"' in out.message.reasoning_content
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in out.message.tool_calls] == [("get_weather", {"city": "Oslo", "unit": "C"})]
    reasoning, content, chunks = streamed(r1, **kw)
    assert reasoning == out.message.reasoning_content
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_under_a_grammar_stays_content(r1):
    """A grammar writes the whole output, so deepseek_r1's implied <think> does not apply."""
    out = chat(r1, seed=3, max_tokens=100,
               response_format={"type": "json_object"}).choices[0].message
    assert out.reasoning_content is None and out.content.lstrip().startswith("{")


def test_responses_api_gives_a_reasoning_item(r1):
    """Unclosed (deepseek_r1, no </think> in 8 tokens), the whole output is one reasoning item;
    streamed, its reasoning_text deltas join to the same text."""
    kw = dict(model="tiny", input=CHAT[0]["content"], temperature=0, max_output_tokens=8)
    whole = r1.responses.create(**kw)
    assert [o.type for o in whole.output] == ["reasoning"]
    thought = whole.output[0].content[0].text
    same = chat(r1, temperature=0, max_tokens=8).choices[0].message
    assert thought == same.reasoning_content
    events = list(r1.responses.create(stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning"] and deltas == thought
    assert done[0].content[0].text == thought


def test_qwen3_needs_its_opening_tag_and_honours_enable_thinking(engine_model):
    srv, client = _client(engine_model, reasoning_parser="qwen3")
    try:
        msg = chat(client, seed=1, extra_body={"guided_regex": THOUGHT}).choices[0].message
        assert msg.reasoning_content and "think>" not in msg.content
        off = chat(client, seed=1, extra_body={"guided_regex": THOUGHT, "chat_template_kwargs": {
            "enable_thinking": False}}).choices[0].message
        assert off.reasoning_content is None and off.content.startswith("<think>")
        _, content, _ = streamed(client, seed=1, extra_body={
            "guided_regex": THOUGHT, "chat_template_kwargs": {"enable_thinking": False}})
        assert content == off.content
        plain = chat(client, max_tokens=6).choices[0].message  # no <think>: all content
        assert plain.reasoning_content is None and plain.content
    finally:
        srv.stop()


def test_unknown_parser_is_refused_with_the_list(engine_model):
    engine = LLMEngine.from_config(EngineConfig(
        model=str(engine_model), max_model_len=256, kv_cache_memory=1 << 20, dtype="float32"))
    with pytest.raises(ConfigError, match="'granite'.*deepseek_r1, qwen3"):
        create_app(engine, ServerConfig(reasoning_parser="granite"))


def _ids(chunks: list) -> list[int]:
    return [i for c in chunks if c.choices for i in (getattr(c.choices[0], "token_ids", None)
                                                        or [])]


def _parts(chunks: list) -> tuple[str, str, list[tuple[str | None, str, str]]]:
    """(reasoning, content, tool calls as (id, name, arguments) folded by index) of chunks."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, list] = {}
    for d in deltas:
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, [None, "", ""])
            call[0] = t.id or call[0]
            call[1] += (t.function.name or "") if t.function else ""
            call[2] += (t.function.arguments or "") if t.function else ""
    return ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas), [tuple(calls[i]) for i in sorted(calls)])


def test_a_continuation_goes_on_with_the_reasoning_and_tool_call_parsers_state(r1):
    """What a migrated stream's continuation gets (the ids of the chunks delivered before a
    break, any break) on a replica with --reasoning-parser and tools: the parsers restart from
    the delivered text and the grammar is advanced over it, so the delivered chunks and the
    continuation's join into the uninterrupted answer: the same reasoning, content and one
    get_weather call (its id said once, its name once, its arguments whole)."""
    extra = {"guided_regex": CALL_IN_BOTH, "return_token_ids": True}
    kw = dict(tools=[WEATHER, TIME], seed=2, extra_body=extra)
    chunks = list(chat(r1, stream=True, **kw))
    reasoning, content, calls = _parts(chunks)
    assert reasoning and [c[1] for c in calls] == ["get_weather"] and calls[0][0]
    ids = _ids(chunks)
    cuts = [k for k in range(1, len(chunks)) if _ids(chunks[:k]) and _ids(chunks[k:])]
    assert len(cuts) >= 5  # breaks in the reasoning, at its end and in the call
    for k in sorted({*cuts[::max(1, len(cuts) // 8)], cuts[-1]}):  # spread over the answer
        sent = chunks[:k]
        rest = list(chat(r1, stream=True, **{**kw, "extra_body": {
            **extra, "continuation": {"token_ids": _ids(sent)}}}))
        assert _ids(sent) + _ids(rest) == ids, k
        r_sent, c_sent, calls_sent = _parts(sent)
        r_rest, c_rest, calls_rest = _parts(rest)
        assert (r_sent + r_rest, c_sent + c_rest) == (reasoning, content), k
        joined = _parts(sent + rest)[2]  # a call begun before the break goes on by its index
        assert [(name, json.loads(args)) for _, name, args in joined] == \
            [("get_weather", {"city": "Oslo", "unit": "C"})], k
        assert sum(1 for c in calls_sent + calls_rest if c[0]) == 1, k
        assert rest[-1].choices[0].finish_reason == "tool_calls"

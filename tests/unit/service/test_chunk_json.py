"""Stream chunks framed by service/server/chunk_json.py are byte for byte what the pydantic
response models write for the same chunk: content with escapes and non-ASCII text, role chunks,
finish and stop reasons, logprobs (with -inf), usage with and without cached-token details,
several choices (n > 1) and the usage-only chunk."""

from __future__ import annotations

import json

import pytest

from kvserve.service.response_models import (ChatCompletionChunk, ChatLogProbs, ChatStreamChoice,
                                             ChatTokenLogprob, CompletionChoice,
                                             CompletionLogProbs, CompletionStreamResponse, DeltaMessage,
                                             PromptTokensDetails, TopLogprob, UsageInfo)
from kvserve.service.server.chunk_json import (ChunkFramer, chat_choice, completion_choice,
                                               usage_json)
from kvserve.service.sse import sse

TEXTS = ["", "Hello", 'a "quote" and a back\\slash', "new\nline\ttab\r", "\x00\x01\x1f\x7f",
         "é 日本語 🙂", "\u2028\u2029", "</script>"]
REASONS = [(None, None), ("stop", None), ("stop", 7), ("stop", "###"), ("length", None),
           ("abort", None)]
CREATED = 1_765_000_000


def chat_logprobs() -> ChatLogProbs:
    return ChatLogProbs(content=[
        ChatTokenLogprob(token="Hi", logprob=-0.125, bytes=[72, 105], top_logprobs=[
            TopLogprob(token="Hi", logprob=-0.125, bytes=[72, 105]),
            TopLogprob(token=" é", logprob=-2.5e-7, bytes=list(" é".encode()))]),
        ChatTokenLogprob(token="x", logprob=float("-inf"), bytes=[120], top_logprobs=[])])


def usage_cases() -> list[tuple[UsageInfo | None, str]]:
    return [(None, "null"),
            (UsageInfo.of(250, 3, 224), usage_json(250, 3, 224)),
            (UsageInfo(prompt_tokens=9, completion_tokens=0, total_tokens=9), usage_json(9, 0, None))]


def assert_same(fast: str, model_event: str) -> None:
    assert json.loads(fast[6:]) == json.loads(model_event[6:])  # field by field, for the message
    assert fast == model_event


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", REASONS)
def test_chat_content_chunk_is_the_models_bytes(text, reason):
    finish, stop = reason
    framer = ChunkFramer("chat.completion.chunk", "chatcmpl-1", "tiny", CREATED)
    for (usage, usage_text) in usage_cases():
        for lp in (None, chat_logprobs()):
            fast = framer.event([chat_choice(0, text, logprobs=lp, finish_reason=finish,
                                             stop_reason=stop)], usage_text)
            model = ChatCompletionChunk(id="chatcmpl-1", model="tiny", created=CREATED, usage=usage,
                                        choices=[ChatStreamChoice(
                                            index=0, delta=DeltaMessage(content=text), logprobs=lp,
                                            finish_reason=finish, stop_reason=stop)])
            assert_same(fast, sse(model))


def test_chat_role_null_content_several_choices_and_usage_only_chunks():
    framer = ChunkFramer("chat.completion.chunk", 'id"odd', "my/model ü", CREATED)
    role = ChatStreamChoice(index=2, delta=DeltaMessage(role="assistant", content=""))
    assert_same(framer.event([chat_choice(2, "", role="assistant")]),
                sse(ChatCompletionChunk(id='id"odd', model="my/model ü", created=CREATED,
                                        choices=[role])))
    # a reasoning parser's content chunk with no content left
    assert_same(framer.event([chat_choice(1, None, finish_reason="stop")]),
                sse(ChatCompletionChunk(id='id"odd', model="my/model ü", created=CREATED, choices=[
                    ChatStreamChoice(index=1, delta=DeltaMessage(content=None),
                                     finish_reason="stop")])))
    # n > 1: several choices in one chunk, and the models' own choices through the framer
    choices = [ChatStreamChoice(index=i, delta=DeltaMessage(content=t), finish_reason=f)
               for i, (t, f) in enumerate([("a", None), ("b", "length"), ("", "stop")])]
    fast = framer.event([chat_choice(c.index, c.delta.content, finish_reason=c.finish_reason)
                         for c in choices])
    model = sse(ChatCompletionChunk(id='id"odd', model="my/model ü", created=CREATED,
                                    choices=choices))
    assert_same(fast, model)
    assert_same(framer.event([c.model_dump_json() for c in choices]), model)
    reasoning = ChatStreamChoice(index=0, delta=DeltaMessage(reasoning_content="r", reasoning="r"))
    assert_same(framer.event([reasoning.model_dump_json()]),
                sse(ChatCompletionChunk(id='id"odd', model="my/model ü", created=CREATED,
                                        choices=[reasoning])))
    for usage, text in usage_cases():
        assert_same(framer.event([], text),
                    sse(ChatCompletionChunk(id='id"odd', model="my/model ü", created=CREATED,
                                            choices=[], usage=usage)))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", REASONS)
def test_completion_chunk_is_the_models_bytes(text, reason):
    finish, stop = reason
    framer = ChunkFramer("text_completion", "cmpl-9", "tiny", CREATED)
    lps = [None, CompletionLogProbs(
        text_offset=[0, 5], token_logprobs=[None, -1.5], tokens=["The", " é"],
        top_logprobs=[None, {" é": -1.5, "\n": float("-inf")}])]
    for usage, usage_text in usage_cases():
        for lp in lps:
            for index in (0, 3):  # prompt i, choice j of n: index i * n + j
                fast = framer.event([completion_choice(index, text, logprobs=lp,
                                                       finish_reason=finish, stop_reason=stop)],
                                    usage_text)
                model = CompletionStreamResponse(id="cmpl-9", model="tiny", created=CREATED,
                                           usage=usage, choices=[CompletionChoice(
                                               index=index, text=text, logprobs=lp,
                                               finish_reason=finish, stop_reason=stop)])
                assert_same(fast, sse(model))


def test_usage_json_is_usage_info():
    for prompt, completion, cached in [(0, 0, 0), (250, 32, 224), (1, 2, None)]:
        model = UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                          total_tokens=prompt + completion,
                          prompt_tokens_details=None if cached is None
                          else PromptTokensDetails(cached_tokens=cached))
        assert usage_json(prompt, completion, cached) == model.model_dump_json()

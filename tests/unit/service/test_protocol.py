"""Request models: OpenAI/vLLM field names, prompt shapes, and the checks that become 400s."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.service.chat_request import ChatCompletionRequest
from kvserve.service.openai_errors import error_body, validation_error
from kvserve.service.request_models import CompletionRequest
from kvserve.service.response_models import UsageInfo
from kvserve.service.server.stream_deltas import StreamTracker, stop_hold
from kvserve.service.tokenize_request import TokenizeRequest


def test_completion_prompt_shapes():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]


def test_completion_defaults_to_16_tokens_and_ignores_unknown_fields():
    req = CompletionRequest.model_validate({"prompt": "x", "vendor_extra": 1})
    assert req.max_tokens == 16
    assert not hasattr(req, "vendor_extra")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
])
def test_completion_checks(body, param):
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate(body).check()
    assert info.value.param == param


def test_chat_max_completion_tokens_wins_and_logprobs_map():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3})
    req.check()
    assert req.requested_max_tokens == 7
    assert req.num_logprobs == 3
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert plain.requested_max_tokens is None and plain.num_logprobs is None


def test_chat_checks():
    with pytest.raises(InvalidRequestError):
        ChatCompletionRequest(messages=[]).check()
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                              max_completion_tokens=0).check()
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2).check()


def test_content_parts_flatten_to_text_and_images_are_refused():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    img = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(InvalidRequestError):
        img.messages[0].as_template_input()


def test_sampling_params_carry_every_field():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "temperature": 0.5, "top_p": 0.9,
        "top_k": 4, "min_p": 0.1, "seed": 7, "stop": ["\n"], "n": 2, "ignore_eos": True,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
        "min_tokens": 2})
    p = req.sampling_params(max_tokens=9, logprobs=None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.n) == (0.5, 0.9, 4, 0.1, 7, 2)
    assert p.stop_strings == ["\n"] and p.ignore_eos and p.max_tokens == 9 and p.min_tokens == 2
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)


def test_out_of_range_sampling_value_is_an_invalid_request():
    req = CompletionRequest(prompt="x", temperature=-1)
    with pytest.raises(InvalidRequestError) as info:
        req.sampling_params(max_tokens=4, logprobs=None)
    assert info.value.param == "temperature"


def test_tokenize_needs_exactly_one_input():
    with pytest.raises(InvalidRequestError):
        TokenizeRequest().check()
    with pytest.raises(InvalidRequestError):
        TokenizeRequest(prompt="a", messages=[{"role": "user", "content": "b"}]).check()
    TokenizeRequest(prompt="a").check()


def test_validation_error_names_the_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "temperature": "hot"})
    err = validation_error(info.value)
    assert err.status == 400 and err.param == "temperature"


def test_error_body_is_openai_shaped():
    body = error_body(404, "no such model", "model", "model_not_found")
    assert body == {"error": {"message": "no such model", "type": "not_found_error",
                              "param": "model", "code": "model_not_found"}}


def test_usage_totals():
    u = UsageInfo.of(prompt=10, completion=5, cached=8)
    assert u.total_tokens == 15 and u.prompt_tokens_details.cached_tokens == 8


def _out(text: str, ids: list[int], reason: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=reason)


def test_stream_tracker_deltas_concatenate_to_the_final_text():
    tracker = StreamTracker()
    parts = [tracker.delta(0, _out("Hel", [1])), tracker.delta(0, _out("Hello", [1, 2])),
             tracker.delta(0, _out("Hello", [1, 2, 3])),  # no new text: nothing to send
             tracker.delta(0, _out("Hello!", [1, 2, 3, 4], "length"))]
    assert parts[2] is None
    assert "".join(p.text for p in parts if p) == "Hello!"
    assert parts[3].finish_reason == "length" and parts[3].token_ids == [3, 4]
    assert tracker.delta(0, _out("Hello!", [1, 2, 3, 4], "length")) is None


def test_stream_tracker_holds_back_a_possible_stop_string():
    hold = stop_hold(SamplingParams(stop=["END"]))
    assert hold == 2
    tracker = StreamTracker(hold=hold)
    assert tracker.delta(0, _out("ab", [1])) is None  # "ab" could still grow into "...END"
    first = tracker.delta(0, _out("abcE", [1, 2]))
    assert first.text == "ab" and first.token_ids == [1]  # "cE" held, with its token
    # The engine cut "EN..." off when the stop string completed: the client never saw it.
    last = tracker.delta(0, _out("abc", [1, 2, 3], "stop"))
    assert first.text + last.text == "abc" and last.token_ids == [2, 3]


def test_json_depth_is_counted_exactly_and_deep_input_never_recurses():
    from kvserve.service.request_validation import parse_json_object

    def nested(levels: int) -> bytes:  # the top-level object is level 1
        return b'{"a": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"

    assert parse_json_object(nested(32), 32)
    for body in (nested(33), nested(200_000)):
        with pytest.raises(InvalidRequestError, match="nested deeper than 32"):
            parse_json_object(body, 32)


@pytest.mark.parametrize("raw, match", [
    (b'{"prompt": "\\ud800"}', "surrogate"),
    (b'{"a": {"b": ["ok", "\\udfff"]}}', "surrogate"),
    (b'[1, 2]', "JSON object"),
    (b'{"a": \xff}', "not valid JSON"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_bodies_that_are_not_valid_json_objects(raw, match):
    from kvserve.service.request_validation import parse_json_object

    with pytest.raises(InvalidRequestError, match=match):
        parse_json_object(raw, 32)


def test_unsupported_fields_are_named_and_harmless_values_pass():
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "x"}],
            "bad_words": ["x"]}).check()
    assert info.value.param == "bad_words"
    ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "auto",
        "response_format": {"type": "text"}, "best_of": 1}).check()

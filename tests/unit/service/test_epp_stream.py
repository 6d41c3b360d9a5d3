"""One ext_proc stream through the EPP, message by message, over a real Router (static
endpoints): the FULL_DUPLEX_STREAMED and BUFFERED sequences, the subset hint, 503, 429 shedding,
400, the response path (chunks echoed, usage counted, in-flight released), the fallback list."""

from __future__ import annotations

import json

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvserve.service.epp import messages as m
from kvserve.service.epp.endpoints import endpoint_url
from kvserve.service.epp.metrics import EppMetrics
from kvserve.service.epp.objectives import Objectives, Saturation
from kvserve.service.epp.picker import Picker
from kvserve.service.epp.stream import ExtProcStream
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.routing import Router

EPS = ("10.0.0.1:8000", "10.0.0.2:8000")
FULL, BUFFERED = ProcessingMode.FULL_DUPLEX_STREAMED, ProcessingMode.BUFFERED
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi " * 40}]})


def make_stream(**picker_kw) -> tuple[ExtProcStream, Picker, EppMetrics]:
    router = Router(RouterConfig(replicas=tuple(endpoint_url(e) for e in EPS)))
    metrics = EppMetrics(router.metrics.registry)
    picker = Picker(router, metrics, **picker_kw)
    return ExtProcStream(picker, metrics), picker, metrics


def headers_msg(mode=FULL, eos=False, path="/v1/chat/completions", **extra: str
                ) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    for key, value in {":path": path, ":method": "POST", **extra}.items():
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = key.replace("_", "-"), value.encode()
    req.request_headers.end_of_stream = eos
    req.protocol_config.request_body_mode = mode
    req.protocol_config.response_body_mode = mode
    return req


def body_msg(data: bytes, eos: bool, response: bool = False) -> pb.ProcessingRequest:
    body = pb.HttpBody(body=data, end_of_stream=eos)
    return pb.ProcessingRequest(response_body=body) if response else \
        pb.ProcessingRequest(request_body=body)


def destination(resp: pb.ProcessingResponse, kind: str) -> str:
    common = getattr(resp, kind).response
    [opt] = [o for o in common.header_mutation.set_headers if o.header.key == m.DESTINATION_HEADER]
    meta = resp.dynamic_metadata.fields[m.LB_NAMESPACE].struct_value
    assert meta.fields[m.DESTINATION_HEADER].string_value == opt.header.raw_value.decode()
    return opt.header.raw_value.decode()


async def test_full_duplex_holds_the_headers_until_the_body_is_complete():
    stream, picker, metrics = make_stream()
    assert await stream.handle(headers_msg()) == []
    data = BODY.encode()
    assert await stream.handle(body_msg(data[:30], False)) == []
    out = await stream.handle(body_msg(data[30:], True))
    assert out[0].HasField("request_headers")
    assert destination(out[0], "request_headers") in EPS
    streamed = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert b"".join(s.body for s in streamed) == data and streamed[-1].end_of_stream
    assert sum(picker.router.replicas.inflight.values()) == 1


async def test_buffered_answers_headers_at_once_and_routes_on_the_body():
    stream, _, _ = make_stream()
    [first] = await stream.handle(headers_msg(BUFFERED))
    assert first.HasField("request_headers")
    assert not first.request_headers.response.header_mutation.set_headers
    [routed] = await stream.handle(body_msg(BODY.encode(), True))
    assert destination(routed, "request_body") in EPS
    assert not routed.request_body.response.HasField("body_mutation")


async def test_a_request_without_body_is_routed_on_its_headers():
    stream, _, _ = make_stream()
    [routed] = await stream.handle(headers_msg(eos=True, path="/v1/models"))
    assert destination(routed, "request_headers") in EPS


async def test_subset_hint_narrows_and_an_empty_one_gives_503():
    stream, _, _ = make_stream()
    await stream.handle(headers_msg(x_gateway_destination_endpoint_subset=EPS[1]))
    out = await stream.handle(body_msg(BODY.encode(), True))
    assert destination(out[0], "request_headers") == EPS[1]
    stream, _, metrics = make_stream()
    req = headers_msg()
    req.metadata_context.filter_metadata[m.SUBSET_NAMESPACE].update(
        {m.SUBSET_KEY: ["10.9.9.9:8000"]})
    await stream.handle(req)
    [refused] = await stream.handle(body_msg(BODY.encode(), True))
    assert refused.immediate_response.status.code == 503
    assert metrics.decisions.labels("no_endpoint")._value.get() == 1


async def test_sheddable_objective_gets_429_only_when_saturated():
    objectives = Objectives({"batch": -1, "chat": 5})
    saturated = Saturation(queue_depth=0)  # every replica counts as saturated
    for objective, sat, want in (("batch", saturated, 429), ("chat", saturated, 200),
                                 ("batch", Saturation(), 200)):
        stream, _, metrics = make_stream(objectives=objectives, saturation=sat)
        await stream.handle(headers_msg(x_gateway_inference_objective=objective))
        out = await stream.handle(body_msg(BODY.encode(), True))
        code = out[0].immediate_response.status.code if out[0].HasField(
            "immediate_response") else 200
        assert code == want, (objective, sat)
        assert metrics.shed.labels(objective)._value.get() == (want == 429)


async def test_a_body_that_is_not_json_gets_400():
    stream, _, _ = make_stream()
    await stream.handle(headers_msg())
    [refused] = await stream.handle(body_msg(b"{not json", True))
    assert refused.immediate_response.status.code == 400


async def test_response_chunks_are_echoed_usage_counted_and_the_slot_released():
    stream, picker, metrics = make_stream()
    await stream.handle(headers_msg())
    await stream.handle(body_msg(BODY.encode(), True))
    resp_headers = pb.ProcessingRequest()
    h = resp_headers.response_headers.headers.headers.add()
    h.key, h.raw_value = "content-type", b"text/event-stream"
    resp_headers.metadata_context.filter_metadata[m.LB_NAMESPACE].update(
        {m.SERVED_KEY: "10.7.7.7:8000"})
    [ack] = await stream.handle(resp_headers)
    assert ack.HasField("response_headers")
    chunks = [b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
              b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}'
              b'\n\ndata: [DONE]\n\n']
    echoed = []
    for i, chunk in enumerate(chunks):
        out = await stream.handle(body_msg(chunk, i == len(chunks) - 1, response=True))
        echoed += [r.response_body.response.body_mutation.streamed_response for r in out]
    assert b"".join(e.body for e in echoed) == b"".join(chunks) and echoed[-1].end_of_stream
    assert metrics.tokens.labels("prompt")._value.get() == 9
    assert metrics.tokens.labels("completion")._value.get() == 2
    assert metrics.served_elsewhere._value.get() == 1
    assert sum(picker.router.replicas.inflight.values()) == 0
    stream.finish()  # the stream closing afterwards releases nothing twice
    assert sum(picker.router.replicas.inflight.values()) == 0


async def test_usage_is_counted_when_envoy_skips_the_response_headers():
    """response_header_mode SKIP: the first response message is a body chunk; an SSE stream is
    recognised by its bytes and its usage counted, a JSON answer's too."""
    for chunks, tokens in (([b'data: {"choices": []}\n\n', b'data: {"choices": [], "usage": '
                             b'{"prompt_tokens": 5, "completion_tokens": 3}}\n\ndata: [DONE]\n\n'],
                            (5, 3)),
                           ([b'{"choices": [], "usage": {"prompt_tokens": 4, ',
                             b'"completion_tokens": 1}}'], (4, 1))):
        stream, picker, metrics = make_stream()
        await stream.handle(headers_msg())
        await stream.handle(body_msg(BODY.encode(), True))
        before = (metrics.tokens.labels("prompt")._value.get(),
                  metrics.tokens.labels("completion")._value.get())
        for i, chunk in enumerate(chunks):
            await stream.handle(body_msg(chunk, i == len(chunks) - 1, response=True))
        assert (metrics.tokens.labels("prompt")._value.get() - before[0],
                metrics.tokens.labels("completion")._value.get() - before[1]) == tokens
        assert sum(picker.router.replicas.inflight.values()) == 0


async def test_fallback_list_sends_every_endpoint_best_first():
    stream, _, _ = make_stream(fallback_list=True)
    await stream.handle(headers_msg())
    out = await stream.handle(body_msg(BODY.encode(), True))
    assert sorted(destination(out[0], "request_headers").split(",")) == sorted(EPS)


async def test_load_spreads_the_picks():
    """Least load among equal replicas: two requests in flight go to two replicas."""
    picks = set()
    stream, picker, _ = make_stream()
    for _ in EPS:
        s = ExtProcStream(picker, stream.metrics)
        await s.handle(headers_msg())
        out = await s.handle(body_msg(BODY.encode(), True))
        picks.add(destination(out[0], "request_headers"))
    assert picks == set(EPS)

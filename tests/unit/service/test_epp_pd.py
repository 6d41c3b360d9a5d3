"""The EPP under `--policy pd`: an ext_proc stream over a real Router (two static endpoints, both
role `both`, the tiny model's tokenizer) names the prefill replica in llm-d's
`x-prefiller-host-port` when the uncached prompt exceeds the threshold, and nothing else when the
decode replica should prefill locally."""

from __future__ import annotations

import json

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.service.epp import messages as m
from kvserve.service.epp.endpoints import endpoint_url
from kvserve.service.epp.metrics import EppMetrics
from kvserve.service.epp.picker import Picker
from kvserve.service.epp.stream import ExtProcStream
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.pd import PDConfig
from kvserve.service.router.routing import Router

EPS = ("10.0.0.1:8000", "10.0.0.2:8000")
THRESHOLD = 128  # the templated "hi" is ~70 tokens, the long prompt ~430


def make_stream(model_dir, policy: str = "pd") -> tuple[ExtProcStream, Router]:
    router = Router(RouterConfig(replicas=tuple(endpoint_url(e) for e in EPS), policy=policy,
                                 pd=PDConfig(threshold=THRESHOLD)))
    router.prompts.tokenizer = load_tokenizer(str(model_dir))
    metrics = EppMetrics(router.metrics.registry)
    return ExtProcStream(Picker(router, metrics), metrics), router


def request(stream: ExtProcStream, content: str) -> pb.ProcessingResponse:
    req = pb.ProcessingRequest()
    for key, value in {":path": "/v1/chat/completions", ":method": "POST"}.items():
        h = req.request_headers.headers.headers.add()
        h.key, h.raw_value = key, value.encode()
    req.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    return req, pb.ProcessingRequest(request_body=pb.HttpBody(
        body=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}]})
        .encode(), end_of_stream=True))


async def routed_headers(stream: ExtProcStream, content: str) -> dict[str, str]:
    headers, body = request(stream, content)
    await stream.handle(headers)
    [routed] = await stream.handle(body)
    return {o.header.key: o.header.raw_value.decode()
            for o in routed.request_body.response.header_mutation.set_headers}


def decisions(router: Router, decision: str) -> float:
    return router.metrics.pd_decisions.labels(decision)._value.get()


async def test_long_prompt_names_the_other_replica_as_prefiller(tiny_model_dir):
    stream, router = make_stream(tiny_model_dir)
    headers = await routed_headers(stream, "paged attention keeps blocks " * 20)
    decode, prefill = headers[m.DESTINATION_HEADER], headers[m.PREFILLER_HEADER]
    assert {decode, prefill} == set(EPS)
    assert decisions(router, "remote") == 1


async def test_short_prompt_is_prefilled_by_the_decode_replica(tiny_model_dir):
    stream, router = make_stream(tiny_model_dir)
    headers = await routed_headers(stream, "hi")
    assert headers[m.DESTINATION_HEADER] in EPS and m.PREFILLER_HEADER not in headers
    assert decisions(router, "local_short") == 1


async def test_other_policies_never_name_a_prefiller(tiny_model_dir):
    stream, router = make_stream(tiny_model_dir, policy="prefix")
    headers = await routed_headers(stream, "paged attention keeps blocks " * 20)
    assert m.PREFILLER_HEADER not in headers
    assert decisions(router, "remote") == 0

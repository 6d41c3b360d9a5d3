"""The EPP's ext_proc messages: the subset hint and served endpoint read from Envoy's metadata, the
endpoint written as header + `envoy.lb` metadata, streamed chunks, immediate answers."""

from __future__ import annotations

import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvserve.service.epp import messages as m


def request_with_metadata(namespace: str, fields: dict) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    req.metadata_context.filter_metadata[namespace].update(fields)
    return req


def test_subset_hint_from_metadata_list_then_header_then_none():
    req = request_with_metadata(m.SUBSET_NAMESPACE,
                                {m.SUBSET_KEY: ["10.0.0.1:8000", "10.0.0.2:8000"]})
    assert m.subset_hint(req, {}) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    header = {m.SUBSET_KEY: "10.0.0.3:8000, 10.0.0.4:8000"}
    assert m.subset_hint(pb.ProcessingRequest(), header) == {"10.0.0.3:8000", "10.0.0.4:8000"}
    assert m.subset_hint(req, header) == {"10.0.0.1:8000", "10.0.0.2:8000"}  # metadata wins
    assert m.subset_hint(pb.ProcessingRequest(), {}) is None
    empty = request_with_metadata(m.SUBSET_NAMESPACE, {m.SUBSET_KEY: []})
    assert m.subset_hint(empty, {}) == frozenset()  # an empty list allows nothing


def test_served_endpoint():
    req = request_with_metadata(m.LB_NAMESPACE, {m.SERVED_KEY: "10.0.0.9:8000"})
    assert m.served_endpoint(req) == "10.0.0.9:8000"
    assert m.served_endpoint(pb.ProcessingRequest()) is None


def test_routed_headers_reply_sets_header_metadata_and_clears_route_cache():
    resp = m.request_headers_reply(m.routed_common("10.0.0.1:8000"), "10.0.0.1:8000")
    common = resp.request_headers.response
    assert common.clear_route_cache
    [opt] = common.header_mutation.set_headers
    assert (opt.header.key, opt.header.raw_value) == (m.DESTINATION_HEADER, b"10.0.0.1:8000")
    lb = resp.dynamic_metadata.fields[m.LB_NAMESPACE].struct_value
    assert lb.fields[m.DESTINATION_HEADER].string_value == "10.0.0.1:8000"


def test_streamed_chunks_split_under_the_limit_with_eos_on_the_last_only():
    body = bytes(range(256)) * 600  # 153,600 bytes: three chunks
    out = m.streamed_chunks(body, end_of_stream=True)
    parts = [r.request_body.response.body_mutation.streamed_response for r in out]
    assert b"".join(p.body for p in parts) == body
    assert [p.end_of_stream for p in parts] == [False, False, True]
    assert all(len(p.body) <= m.CHUNK_BYTES for p in parts)
    [resp] = m.streamed_chunks(b"", end_of_stream=False, response=True)
    assert resp.HasField("response_body")
    assert not resp.response_body.response.body_mutation.streamed_response.end_of_stream


def test_immediate_answer_is_an_openai_error():
    resp = m.immediate(503, "nothing eligible", "no_endpoint").immediate_response
    assert resp.status.code == 503
    assert json.loads(resp.body)["error"] == {"message": "nothing eligible",
                                              "type": "no_endpoint", "code": 503}


def test_headers_of_reads_raw_values_lower_cased():
    headers = pb.HttpHeaders()
    h = headers.headers.headers.add()
    h.key, h.raw_value = "X-Gateway-Inference-Objective", b"batch"
    h2 = headers.headers.headers.add()
    h2.key, h2.value = ":path", "/v1/completions"
    assert m.headers_of(headers) == {"x-gateway-inference-objective": "batch",
                                     ":path": "/v1/completions"}

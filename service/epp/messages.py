"""ext_proc messages the EPP reads and writes (envoy.service.ext_proc.v3), as small pure functions:
the picked endpoint as a header and as `envoy.lb` dynamic metadata, streamed body chunks, the
immediate 503/429, and the subset hint and served endpoint read from Envoy's metadata."""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# --policy pd: the prefill replica (host:port) a P/D sidecar on the decode pod prefills on first
# (llm-d's routing sidecar reads it); absent when the decode replica prefills locally.
PREFILLER_HEADER = "x-prefiller-host-port"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Some Envoy builds cap one streamed chunk at 64 KiB: stay below with a margin.
CHUNK_BYTES = 62_000


def headers_of(http_headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased header map of a request or response headers message (raw_value or value)."""
    out: dict[str, str] = {}
    for h in http_headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode(errors="replace") if h.raw_value else h.value
    return out


def _set(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()),
                             append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def destination_metadata(value: str) -> Struct:
    """`{"envoy.lb": {"x-gateway-destination-endpoint": value}}`."""
    meta = Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: value}})
    return meta


def routed_common(value: str, prefill: str | None = None) -> pb.CommonResponse:
    """The header mutation that routes: the endpoint header (and, for a remote prefill, the
    prefill replica's), with the route cache cleared so Envoy picks the route (the ORIGINAL_DST
    cluster) again. (A streamed body goes upstream chunked: Envoy drops Content-Length itself.)"""
    headers = [_set(DESTINATION_HEADER, value)]
    if prefill is not None:
        headers.append(_set(PREFILLER_HEADER, prefill))
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers),
                             clear_route_cache=True)


def request_headers_reply(common: pb.CommonResponse | None = None,
                          value: str | None = None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common or pb.CommonResponse()))
    if value is not None:
        resp.dynamic_metadata.CopyFrom(destination_metadata(value))
    return resp


def request_body_reply(common: pb.CommonResponse | None = None,
                       value: str | None = None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common or pb.CommonResponse()))
    if value is not None:
        resp.dynamic_metadata.CopyFrom(destination_metadata(value))
    return resp


def streamed_chunks(body: bytes, end_of_stream: bool, response: bool = False
                    ) -> list[pb.ProcessingResponse]:
    """`body` sent back to Envoy as streamed body mutations (FULL_DUPLEX_STREAMED), in chunks
    under CHUNK_BYTES; the last one carries `end_of_stream`."""
    pieces = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        eos = end_of_stream and i == len(pieces) - 1
        mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=piece, end_of_stream=eos))
        common = pb.CommonResponse(body_mutation=mutation)
        out.append(pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
                   if response else
                   pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)))
    return out


def immediate(status: int, message: str, code: str) -> pb.ProcessingResponse:
    """An OpenAI-style JSON error answered by Envoy itself (503: nothing eligible, 429: shed)."""
    body = json.dumps({"error": {"message": message, "type": code, "code": status}})
    headers = pb.HeaderMutation(set_headers=[_set("content-type", "application/json")])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=status), headers=headers, body=body.encode(),
        details=f"kvserve_epp_{code}"))


def _metadata_field(req: pb.ProcessingRequest, namespace: str, key: str):
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key]


def subset_hint(req: pb.ProcessingRequest, headers: dict[str, str]) -> frozenset[str] | None:
    """The endpoints the data plane allows (`envoy.lb.subset_hint` metadata, else the
    x-gateway-destination-endpoint-subset header); None when it sets none."""
    value = _metadata_field(req, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is not None:
        kind = value.WhichOneof("kind")
        items: Iterable[str] = ([v.string_value for v in value.list_value.values]
                                if kind == "list_value" else value.string_value.split(","))
        return frozenset(i.strip() for i in items if i.strip())
    if SUBSET_KEY in headers:
        return frozenset(i.strip() for i in headers[SUBSET_KEY].split(",") if i.strip())
    return None


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """`envoy.lb/x-gateway-destination-endpoint-served` on the response path, if Envoy set it."""
    value = _metadata_field(req, LB_NAMESPACE, SERVED_KEY)
    return value.string_value or None if value is not None else None

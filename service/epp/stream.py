"""One ext_proc stream (one HTTP request through Envoy): the message sequence of the GIE protocol.

FULL_DUPLEX_STREAMED: Envoy sends the headers and every body chunk without waiting; the EPP holds
its answer to the headers until the body is complete, then sends the headers answer (endpoint
header + `envoy.lb` metadata) followed by the whole body back as streamed mutations (Envoy
forwards only what the processor returns). BUFFERED: the headers are answered at once and the
routing header rides on the body's answer. Response bodies stream back chunk by chunk."""

from __future__ import annotations

import json
import logging
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvserve.service.epp import messages as m
from kvserve.service.epp.metrics import EppMetrics
from kvserve.service.epp.picker import Pick, Picker
from kvserve.service.epp.usage import UsageReader

logger = logging.getLogger("kvserve.epp")
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = ProcessingMode.NONE

Replies = list[pb.ProcessingResponse]


class ExtProcStream:
    """Turns each ProcessingRequest into the ProcessingResponses to send, in order."""

    def __init__(self, picker: Picker, metrics: EppMetrics) -> None:
        self.picker, self.metrics = picker, metrics
        # Without protocol_config (Envoy before 1.33) assume GIE's standard mode.
        self.request_mode, self.response_mode = FULL_DUPLEX, FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.picked: Pick | None = None
        self.usage: UsageReader | None = None
        self.done = False

    async def handle(self, req: pb.ProcessingRequest) -> Replies:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(req)
        if kind == "request_body":
            return await self._request_body(req.request_body)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return self._response_headers(req)
        if kind == "response_body":
            return self._response_body(req.response_body)
        if kind == "response_trailers":
            self.finish()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def _request_headers(self, req: pb.ProcessingRequest) -> Replies:
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        self.headers = m.headers_of(req.request_headers)
        self.subset = m.subset_hint(req, self.headers)
        if req.request_headers.end_of_stream or self.request_mode == NO_BODY:
            pick = await self._pick(None)  # no body to read: route by load
            if pick.status != 200:
                return [self._refuse(pick)]
            return [m.request_headers_reply(m.routed_common(pick.value), pick.value)]
        if self.request_mode == FULL_DUPLEX:
            return []  # answered with the body: the endpoint depends on it
        return [m.request_headers_reply()]

    async def _request_body(self, chunk: pb.HttpBody) -> Replies:
        self.body += chunk.body
        if not chunk.end_of_stream:
            return []
        return await self._route_body(end_of_stream=True)

    async def _request_trailers(self) -> Replies:
        """Trailers end the body (HTTP/2 with trailers): route now if not done yet."""
        out = await self._route_body(end_of_stream=False) if self.picked is None else []
        if out and out[0].HasField("immediate_response"):
            return out
        return out + [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]

    async def _route_body(self, end_of_stream: bool) -> Replies:
        try:
            body = json.loads(self.body) if self.body else None
        except ValueError:
            body = "bad"
        if body is not None and not isinstance(body, dict):
            self.metrics.decisions.labels("bad_request").inc()
            return [m.immediate(400, "the request body is not a JSON object", "bad_request")]
        pick = await self._pick(body)
        if pick.status != 200:
            return [self._refuse(pick)]
        value = pick.value
        if self.request_mode == FULL_DUPLEX:
            data = bytes(self.body)
            return [m.request_headers_reply(m.routed_common(value, pick.prefill), value),
                    *m.streamed_chunks(data, end_of_stream)]
        return [m.request_body_reply(m.routed_common(value, pick.prefill), value)]

    async def _pick(self, body: dict[str, Any] | None) -> Pick:
        path = self.headers.get(":path", "/").split("?", 1)[0]
        self.picked = await self.picker.pick(path, body, self.headers, self.subset)
        return self.picked

    def _refuse(self, pick: Pick) -> pb.ProcessingResponse:
        self.done = True
        return m.immediate(pick.status, pick.message, pick.reason)

    def _response_headers(self, req: pb.ProcessingRequest) -> Replies:
        headers = m.headers_of(req.response_headers)
        served = m.served_endpoint(req)
        if served and self.picked and self.picked.endpoints and served != \
                self.picked.endpoints[0]:
            self.metrics.served_elsewhere.inc()
        self.usage = UsageReader("text/event-stream" in headers.get("content-type", ""))
        if req.response_headers.end_of_stream:
            self.finish()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _response_body(self, chunk: pb.HttpBody) -> Replies:
        if self.usage is None and chunk.body:
            # response_header_mode SKIP (a round trip less before the first byte): no
            # content-type seen, so an SSE stream is told by its first bytes.
            self.usage = UsageReader(chunk.body.lstrip().startswith((b"data:", b":")))
        if self.usage is not None:
            self.usage.feed(chunk.body, chunk.end_of_stream)
        if chunk.end_of_stream:
            self.finish()
        if self.response_mode == FULL_DUPLEX:
            return m.streamed_chunks(chunk.body, chunk.end_of_stream, response=True)
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def finish(self) -> None:
        """The request is over (or the stream closed): give back its in-flight slot, count its
        tokens. Idempotent."""
        if self.done:
            return
        self.done = True
        if self.picked is not None and self.picked.replica_id is not None:
            self.picker.release(self.picked.replica_id)
        if self.usage is not None:
            prompt, completion = self.usage.tokens()
            self.metrics.tokens.labels("prompt").inc(prompt)
            self.metrics.tokens.labels("completion").inc(completion)

"""POST /v1/responses (OpenAI's Responses API): the request runs as a chat completion (same
template, tools, grammar, limits) and its answer, or its stream of chunks, is retold as a Response
object, or as the Responses stream's typed events (output items, text and argument deltas). With
--reasoning-parser the reasoning comes first, as a `reasoning` item."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.service.responses_request import ResponsesRequest
from kvserve.service.responses_stream import finished_response, response_base, retell_stream
from kvserve.service.server.chat import create_chat_completion
from kvserve.service.server.context import ServingContext


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Response:
    chat = req.as_chat(ctx.limits)
    answer = await create_chat_completion(ctx, chat, raw)
    base = response_base(req)
    if not isinstance(answer, StreamingResponse):
        body = json.loads(bytes(answer.body))
        base["model"] = body["model"]
        return JSONResponse(finished_response(base, body["choices"][0], body.get("usage")))
    return StreamingResponse(retell_stream(base, answer.body_iterator),
                             media_type="text/event-stream")

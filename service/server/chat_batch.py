"""POST /v1/chat/completions/batch: vLLM's batched chat completions. `messages` is a list of
conversations; the answer is one chat completion whose choice i answers conversation i. As in
vLLM, no streaming, no tools, no beam search and n = 1."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.chat_request import ChatCompletionRequest, ChatMessage
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.request_validation import read_json_body, validate_request
from kvserve.service.response_models import (ChatChoice, ChatCompletionResponse,
                                             ChatResponseMessage, random_id)
from kvserve.service.server.chat import _logprobs as chat_logprobs  # one implementation
from kvserve.service.server.chat import chat_prompt
from kvserve.service.server.chat_reasoning import reasoning_splitters, split_whole
from kvserve.service.server.context import ServingContext
from kvserve.service.server.engine_streams import (before, collect, start_requests,
                                                   unless_disconnected)
from kvserve.service.server.generate import disconnect_safe
from kvserve.service.server.usage import usage_of


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's BatchChatCompletionRequest: a chat completion request whose `messages` holds
    several conversations; every other field applies to each of them."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(  # type: ignore[assignment]
        min_length=1)

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        # each conversation is then checked as its own chat request (conversations())
        if self.stream:
            raise InvalidRequestError("Batch chat completions do not support streaming; set "
                                      "`stream` to false", param="stream")
        if self.tools:
            raise InvalidRequestError("Batch chat completions do not support tools; remove "
                                      "`tools`", param="tools")
        if self.continuation is not None:  # kvserve's, for one migrated choice
            raise InvalidRequestError("Batch chat completions do not take a continuation; send "
                                      "it to /v1/chat/completions", param="continuation")
        if self.n != 1:
            raise InvalidRequestError("Batch chat completions do not support `n > 1`. Please "
                                      "set `n` to 1.", param="n")
        if len(self.messages) > limits.max_prompts:
            raise InvalidRequestError(
                f"messages holds {len(self.messages)} conversations; at most "
                f"{limits.max_prompts} are allowed in one request (--max-prompts-per-request)",
                param="messages")


def conversations(body: dict[str, Any], limits: RequestLimits) -> list[ChatCompletionRequest]:
    """One chat request per conversation of a batch body (each checked as /v1/chat/completions
    checks its body)."""
    validate_request(body, BatchChatCompletionRequest, limits)
    return [validate_request({**body, "messages": conv}, ChatCompletionRequest, limits)
            for conv in body["messages"]]


def add_chat_batch_route(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/chat/completions/batch")
    async def chat_completions_batch(request: Request) -> Response:
        """Several conversations in one request (vLLM's batched chat completions)."""
        body = read_json_body(await request.body(), ctx.limits)
        return await disconnect_safe(create_batch(ctx, conversations(body, ctx.limits), request))


async def create_batch(ctx: ServingContext, reqs: list[ChatCompletionRequest],
                       raw: Request) -> Response:
    model = ctx.resolve_model(reqs[0].model)
    deadline = ctx.deadline(raw, asyncio.get_running_loop().time())
    with ctx.admitted():
        prompts = [await before(deadline, chat_prompt(ctx, r)) for r in reqs]
        ctx.check_prompts(prompts, "messages")
        params, splits = [], []
        for r, prompt in zip(reqs, prompts):
            param = "max_completion_tokens" if r.max_completion_tokens is not None \
                else "max_tokens"
            max_tokens = ctx.max_tokens_for(len(prompt), r.requested_max_tokens, param,
                                            "messages")
            params.append(r.sampling_params(max_tokens, r.num_logprobs,
                                            ctx.engine.sampling_defaults))
            splits.append(reasoning_splitters(ctx.reasoning, ctx.tokenizer, prompt,
                                              r.chat_template_kwargs, params[-1]))
    request_id = random_id("chatcmpl")
    first = reqs[0]
    streams = await before(deadline, start_requests(
        ctx, request_id, prompts, params, priority=first.priority, cache_salt=first.cache_salt,
        lora_request=ctx.lora_request(first.model)))
    outputs = await unless_disconnected(raw, collect(streams, deadline))
    choices = []
    for i, (r, out, split) in enumerate(zip(reqs, outputs, splits)):
        c = out.outputs[0]
        reasoning, content = split_whole(split, c.text)
        lp = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, r.top_logprobs or 0) \
            if r.logprobs else None
        choices.append(ChatChoice(
            index=i, finish_reason=c.finish_reason or "stop", stop_reason=c.stop_reason,
            logprobs=lp, message=ChatResponseMessage(
                content=content if split is None or content else None,
                reasoning_content=reasoning, reasoning=reasoning)))
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage_of(outputs, ctx.prompt_tokens_details))
    body = response.model_dump()
    if first.return_token_ids:  # vLLM's: each choice's ids (no prompt ids on a batch)
        for choice, out in zip(body["choices"], outputs):
            choice["token_ids"] = list(out.outputs[0].token_ids)
    return JSONResponse(body)

"""What a request handler needs: the engine, the served model names, admission and the limits."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.prompt_embeds import prompt_len
from kvserve.engine.sample.tokenizer import prompt_token_ids, render_chat
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits, check_prompt_tokens
from kvserve.service.openai_errors import APIError
from kvserve.service.server.time_limit import run_with_time_limit
from kvserve.service.server.tokenizer_pool import TokenizerPool
from kvserve.service.tool_parsers import DEFAULT_TOOL_PARSER

# The request header that sets a per-request deadline in seconds (capped by --request-timeout).
TIMEOUT_HEADER = "x-request-timeout"


@dataclass
class ServingContext:
    """What a request handler needs: the engine, the served names and the admission limits."""

    engine: AsyncEngine
    served_model_names: list[str]
    tokenizer: Any  # the HTTP thread's own copy (the engine thread decodes with another)
    max_waiting: int | None = None
    limits: RequestLimits = DEFAULT_LIMITS
    request_timeout: float | None = None  # --request-timeout: seconds, None = no deadline
    trust_request_chat_template: bool = False
    chat_template_time_limit: float = 5.0
    prompt_tokens_details: bool = False  # report cached prompt tokens (they reveal the cache)
    chat_template: str | None = None  # --chat-template: the server's own, trusted
    tool_parser: str = DEFAULT_TOOL_PARSER  # --tool-call-parser
    reasoning: Any = None  # --reasoning-parser's ThinkParser (service/reasoning/), None = off
    tokenizers: TokenizerPool = field(default=None)  # type: ignore[assignment]
    admitting: int = 0  # admitted requests not yet handed to the engine (tokenizing)
    loras: Any = None  # LoRAModels (service/server/lora_models.py) when LoRA is enabled

    def __post_init__(self) -> None:
        if self.tokenizers is None:
            self.tokenizers = TokenizerPool(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with (a LoRA adapter's own); 404 for a model this server does not
        serve."""
        if requested is None or requested in self.served_model_names:
            return self.model_name
        if self.lora_request(requested) is not None:
            return requested
        adapters = list(self.loras.requests) if self.loras is not None else []
        raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                       f"{self.served_model_names + adapters}.", param="model",
                       code="model_not_found")

    def lora_request(self, requested: str | None) -> Any:
        """The LoRARequest a request's `model` names (None: the base model)."""
        return self.loras.get(requested) if self.loras is not None else None

    def admit(self) -> None:
        """503 while draining or dead, 429 when the waiting queue is full."""
        try:
            self.engine.check_accepting()
        except (EngineDrainingError, EngineDeadError) as exc:
            raise unavailable(exc) from exc
        waiting = self.engine.num_waiting + self.admitting
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise APIError(429, f"the server has {waiting} requests waiting "
                           f"(--max-waiting {self.max_waiting}); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """`admit()`, then count the request as waiting while its prompt is tokenized (the
        engine counts it from `add_request` on), so a burst cannot overrun --max-waiting."""
        self.admit()
        self.admitting += 1
        try:
            yield
        finally:
            self.admitting -= 1

    def deadline(self, request: Request, now: float) -> float | None:
        """The request's deadline (event-loop time): --request-timeout, or the shorter
        `X-Request-Timeout` header; None when neither is set."""
        timeout = self.request_timeout
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                asked = math.nan
            if not (math.isfinite(asked) and asked > 0):
                raise APIError(400, f"the {TIMEOUT_HEADER} header must be a positive number of "
                               f"seconds, got {raw[:64]!r}", code="invalid_value")
            timeout = asked if timeout is None else min(asked, timeout)
        return None if timeout is None else now + timeout

    async def encode_prompts(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized off the event loop)."""
        if all(isinstance(p, list) for p in prompts):
            return [list(p) for p in prompts]  # type: ignore[arg-type]
        return await self.tokenizers.run(_encode_prompts, list(prompts))

    async def decode(self, token_ids: list[int]) -> str:
        return await self.tokenizers.run(_decode, token_ids)

    async def chat_token_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                             chat_template: str | None = None,
                             template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a chat, rendered and tokenized off the event loop. A template sent in
        the request is refused unless --trust-request-chat-template, and then runs in
        transformers' sandboxed jinja environment under a time limit."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template in a request is refused: this server does not run templates "
                "sent by clients (start it with --trust-request-chat-template to allow it)",
                param="chat_template")
        limit = self.chat_template_time_limit if chat_template is not None else None
        chat_template = chat_template or self.chat_template
        return await self.tokenizers.run(_chat_ids, messages, add_generation_prompt,
                                         chat_template, template_kwargs, limit)

    def check_prompts(self, prompts: Sequence[Any], param: str) -> None:
        """400 when the tokenized prompts (or prompt embeddings) of one request hold more
        tokens than the cap."""
        check_prompt_tokens([prompt_len(p) for p in prompts], self.limits, param)

    def max_tokens_for(self, prompt_len: int, requested: int | None,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
        """max_tokens for one prompt: the request's, or what fits; 400 past the context length."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt is "
                f"{prompt_len} tokens; shorten it.", param=prompt_param)
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                f"completion). Reduce the prompt or {param}.", param=param)
        return requested


def unavailable(exc: BaseException) -> APIError:
    """503 + Retry-After for a request the server cannot finish (draining, dead, shut down)."""
    return APIError(503, str(exc), code="service_unavailable", headers={"Retry-After": "1"})


# ---- run on the tokenizer pool's threads (each with its own tokenizer) -------------------------
def _encode_prompts(tokenizer: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    return [p if isinstance(p, list) else prompt_token_ids(tokenizer, p) for p in prompts]


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
              chat_template: str | None, template_kwargs: dict[str, Any] | None,
              time_limit: float | None) -> list[int]:
    args = (tokenizer, messages, add_generation_prompt, chat_template, template_kwargs)
    if time_limit is None:
        text = render_chat(*args)
    else:
        try:
            text = run_with_time_limit(time_limit, render_chat, *args)
        except InvalidRequestError as exc:  # the request's template failed or ran too long
            raise InvalidRequestError(str(exc), param="chat_template") from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])

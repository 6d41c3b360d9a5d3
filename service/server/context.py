"""What a request handler needs: the engine, the served model names, admission and the limits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError
from kvserve.engine.errors import InvalidRequestError
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits, check_prompt_tokens
from kvserve.service.openai_errors import APIError


@dataclass
class ServingContext:
    """What a request handler needs: the engine, the served names and the admission limits."""

    engine: AsyncEngine
    served_model_names: list[str]
    tokenizer: Any  # the HTTP thread's own copy (the engine thread decodes with another)
    max_waiting: int | None = None
    limits: RequestLimits = DEFAULT_LIMITS

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested in self.served_model_names:
            return self.model_name
        raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                       f"{self.served_model_names}.", param="model", code="model_not_found")

    def admit(self) -> None:
        """503 while draining or dead, 429 when the waiting queue is full."""
        try:
            self.engine.check_accepting()
        except (EngineDrainingError, EngineDeadError) as exc:
            raise unavailable(exc) from exc
        if self.max_waiting is not None and self.engine.num_waiting >= self.max_waiting:
            raise APIError(429, f"the server has {self.engine.num_waiting} requests waiting "
                           f"(--max-waiting {self.max_waiting}); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})

    def check_prompts(self, prompts: Sequence[list[int]], param: str) -> None:
        """400 when the tokenized prompts of one request hold more tokens than the cap."""
        check_prompt_tokens([len(p) for p in prompts], self.limits, param)

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


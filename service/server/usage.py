"""Token usage of a request's outputs: prompt, completion and cached prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.outputs import RequestOutput
from kvserve.service.response_models import UsageInfo
from kvserve.service.server.chunk_json import usage_json


def usage_counts(outputs: Sequence[RequestOutput], continued: int = 0
                 ) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of `outputs`; `continued`: a continuation's
    tokens, which count as completion tokens though its outputs leave them out."""
    prompt = sum(o.num_prompt_tokens for o in outputs)  # embeddings rows count as tokens
    completion = continued + sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt, completion, sum(o.num_cached_tokens for o in outputs)


def usage_of(outputs: Sequence[RequestOutput], details: bool = True, continued: int = 0
             ) -> UsageInfo:
    """Usage of `outputs`; the cached prompt tokens only with `details`
    (--enable-prompt-tokens-details), since they tell a client what others cached."""
    usage = UsageInfo.of(*usage_counts(outputs, continued))
    if not details:
        usage.prompt_tokens_details = None
    return usage


def usage_text(outputs: Sequence[RequestOutput], details: bool = True, continued: int = 0
               ) -> str:
    """`usage_of(outputs, details)` as JSON, written without the model (stream chunks)."""
    prompt, completion, cached = usage_counts(outputs, continued)
    return usage_json(prompt, completion, cached if details else None)

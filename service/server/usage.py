"""Token usage of a request's outputs: prompt, completion and cached prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.outputs import RequestOutput
from kvserve.service.response_models import UsageInfo


def usage_of(outputs: Sequence[RequestOutput], details: bool = True) -> UsageInfo:
    """Usage of `outputs`; the cached prompt tokens only with `details`
    (--enable-prompt-tokens-details), since they tell a client what others cached."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    usage = UsageInfo.of(prompt, completion, cached)
    if not details:
        usage.prompt_tokens_details = None
    return usage

"""Token usage of a request's outputs: prompt, completion and cached prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.outputs import RequestOutput
from kvserve.service.response_models import UsageInfo


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo.of(prompt, completion, cached)

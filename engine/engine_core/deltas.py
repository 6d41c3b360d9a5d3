"""Core side: the engine's cumulative RequestOutputs cut to what the client has not seen."""

from __future__ import annotations

from kvserve.engine.engine_core.messages import CompletionDelta, RequestDelta
from kvserve.engine.outputs import RequestOutput


class DeltaTracker:
    """How many tokens and logprob entries of each request's samples the client has."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}

    def deltas(self, outputs: list[RequestOutput], whole: set[str]) -> list[RequestDelta]:
        """One RequestDelta per output; `whole` names requests sent as full outputs."""
        return [self._delta(out, out.request_id in whole) for out in outputs]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def _delta(self, out: RequestOutput, whole: bool) -> RequestDelta:
        sent = self._sent.get(out.request_id)
        first = sent is None
        if first:
            sent = self._sent[out.request_id] = {}
        m = out.metrics
        metrics = None if m is None else (m.arrival_time, m.first_scheduled_time,
                                          m.first_token_time, m.last_token_time, m.finished_time)
        outputs: list[CompletionDelta] | None = None
        if not whole:
            outputs = []
            for o in out.outputs:
                tokens, lps = sent.get(o.index, (0, 0))
                outputs.append((o.index, o.token_ids[tokens:],
                                None if o.logprobs is None else o.logprobs[lps:],
                                o.cumulative_logprob, o.finish_reason, o.stop_reason))
                sent[o.index] = (len(o.token_ids), len(o.logprobs) if o.logprobs else 0)
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, out.finished, out.num_cached_tokens, metrics, outputs,
                out.outputs if whole else None, out.prompt_token_ids if first else None,
                out.prompt_logprobs if first else None, out.kv_transfer_params)

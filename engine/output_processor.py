"""OutputProcessor (vLLM v1's output processing, in the engine's own process): each sample's
incremental text tracker (its detokenizer, which also finds stop strings; the core's update
asks it) and the cumulative `RequestOutput` of a request the core moved: best_of's choice,
prompt logprobs, metrics. A core in another process sends deltas instead, folded by
engine/engine_core/client_outputs.py with the same detokenizer (engine/sample/detokenizer.py)."""

from __future__ import annotations

from typing import Any

from kvserve.engine.async_scheduling import PLACEHOLDER
from kvserve.engine.core.beam_group import beam_outputs
from kvserve.engine.core.request import RequestState, TextTracker
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.sample.best_of import select
from kvserve.engine.sample.detokenizer import NoText, new_detokenizer
from kvserve.engine.sample.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def new_text(self, prompt_token_ids: list[int], params: SamplingParams, makes_text: bool
                 ) -> TextTracker:
        """A sample's text tracker; `NoText` where the core's client makes the text."""
        if not makes_text:
            return NoText()
        return new_detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                               params.stop_strings, params.include_stop_str_in_output)

    def make_output(self, state: RequestState) -> RequestOutput:
        """The request's cumulative output as it stands; a continuation's shows only what
        follows its tokens (their text, ids and the choice's index as the client sent them)."""
        skip, chars = state.skip_tokens, state.skip_chars
        outs = [CompletionOutput(index=state.first_index + s.index, text=d.text[chars:],
                                 token_ids=known_tokens(s)[skip:],
                                 cumulative_logprob=s.cumulative_logprob if s.logprobs else None,
                                 logprobs=list(s.logprobs) if s.logprobs else None,
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s, d in zip(state.seqs, state.detoks)]
        cached = max(state.seqs[0].num_cached_tokens, 0)
        if skip:  # a cached continuation token is no prompt token
            cached = min(cached, len(state.prompt_token_ids))
        finished = state.finished or any(o.finish_reason == "abort" for o in outs)
        if state.best_of is not None:
            outs = select(outs, finished, state.best_of)
        if state.beam is not None:  # a beam search's best beams (engine/core/beam_group.py)
            outs = beam_outputs(state.beam, self.tokenizer, state.params.skip_special_tokens)
        # Complete once the prefill is (never changed after: a recompute skips what is recorded).
        prompt_lps = (state.seqs[0].prompt_logprobs or [None]) \
            if state.params.prompt_logprobs is not None else None  # [None]: a 1-token prompt
        embeds = state.prompt_embeds
        return RequestOutput(state.request_id, state.prompt,
                             state.prompt_token_ids if embeds is None else None, outs,
                             finished=finished, num_cached_tokens=cached, metrics=state.metrics,
                             prompt_logprobs=prompt_lps, lora_request=state.lora_request,
                             num_prompt_embeds=0 if embeds is None else int(embeds.shape[0]),
                             kv_transfer_params=state.seqs[0].kv_transfer_params)


def known_tokens(seq: Sequence) -> list[int]:
    """The seq's output tokens without a trailing placeholder (a token still on the device)."""
    ids = seq.output_token_ids
    return ids[:-1] if ids and ids[-1] == PLACEHOLDER else list(ids)

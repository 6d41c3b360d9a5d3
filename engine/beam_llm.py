"""`LLM.beam_search` (vLLM's): each prompt runs as one beam group in the engine core (its beams
share blocks, engine/core/beam_group.py); the outputs are vLLM's `BeamSearchOutput`s, whose
sequences carry the prompt's tokens and text too (vLLM decodes `beam.tokens` whole)."""

from __future__ import annotations

from typing import Any

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sample.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_params,
)


def beam_search(llm: Any, items: list[tuple[str | None, Any]], params: BeamSearchParams,
                lora_request: Any = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """The best `params.beam_width` beams of every prompt ((text, prompt) `items`), best first
    (`llm`: an `LLM`)."""
    width = params.beam_width
    if width > llm.llm_engine.config.max_num_seqs:
        raise InvalidRequestError(f"beam_width={width} exceeds max_num_seqs "
                                  f"{llm.llm_engine.config.max_num_seqs}", "beam_width")
    try:
        sp = beam_params(width, params.max_tokens, params.ignore_eos, params.length_penalty,
                         skip_special_tokens=False)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "beam_width") from None
    outs = llm._run(items, sp, use_tqdm, lora_request=lora_request)
    tok = llm.get_tokenizer()
    return [_output(out, tok, lora) for out, lora in
            zip(outs, _loras(lora_request, len(items)))]


def _loras(lora: Any, n: int) -> list[Any]:
    return list(lora) if isinstance(lora, (list, tuple)) else [lora] * n


def _output(out: RequestOutput, tokenizer: Any, lora: Any) -> BeamSearchOutput:
    prompt = list(out.prompt_token_ids or [])
    seqs = []
    for o in out.outputs:
        tokens = prompt + list(o.token_ids)
        seqs.append(BeamSearchSequence(
            tokens=tokens, logprobs=list(o.logprobs or []), lora_request=lora,
            cum_logprob=float(o.cumulative_logprob or 0.0), text=tokenizer.decode(tokens),
            finish_reason=o.finish_reason, stop_reason=o.stop_reason,
            orig_prompt={"prompt_token_ids": prompt} if out.prompt is None
            else {"prompt": out.prompt, "prompt_token_ids": prompt}))
    return BeamSearchOutput(sequences=seqs)

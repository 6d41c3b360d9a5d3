"""Beam search as vLLM offers it (`vllm/beam_search.py`, `LLM.beam_search`): its params, its
outputs, its score (length penalty over prompt + output, a final EOS left out) and one step's
choice over a beam group's candidates as tensor ops. The group's bookkeeping (forks, frees) is
engine/core/beam_group.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from kvserve.engine.outputs import Logprob
from kvserve.engine.sample.sampling_params import SamplingParams

# The sampler returns at most this many top logprobs (SamplingParams.verify); each beam offers
# 2 * beam_width candidates (vLLM's and HF's rule), so a width above half of it is refused.
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`. `temperature` is accepted and, as in vLLM v1 (whose logprobs
    are the raw model distribution's), changes no candidate's score."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass
class BeamSearchSequence:
    """vLLM's `BeamSearchSequence`: `tokens` are the prompt's and the output's; `logprobs` holds
    one {token_id: Logprob} per output token (the 2 * beam_width candidates of that step)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    orig_prompt: Any = None


@dataclass
class BeamSearchOutput:
    """vLLM's `BeamSearchOutput`: the best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamParams(SamplingParams):
    """What the engine runs for a beam group: greedy rows with 2 * beam_width raw logprobs, and
    the group's width and length penalty (engine/core/beam_group.py reads them)."""

    beam_width: int = 1
    length_penalty: float = 1.0


def beam_params(width: int, max_tokens: int | None, ignore_eos: bool = False,
                length_penalty: float = 1.0, skip_special_tokens: bool = True) -> BeamParams:
    """The engine's params of a beam search of `width` beams (ValueError past MAX_BEAM_WIDTH)."""
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {width}")
    return BeamParams(n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                      logprobs=2 * width, skip_special_tokens=skip_special_tokens,
                      beam_width=width, length_penalty=length_penalty)


def is_beam(params: Any) -> bool:
    return isinstance(params, BeamParams)


def beam_score(num_tokens: int, cum_logprob: float, ends_in_eos: bool,
               length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: `num_tokens` counts prompt and output; a final EOS is
    not counted."""
    seq_len = num_tokens - 1 if ends_in_eos else num_tokens
    return cum_logprob / (seq_len ** length_penalty)


@dataclass
class StepChoice:
    """One step's choice for a group: `finished` (beam, candidate) pairs that ended on EOS (every
    such candidate, as vLLM keeps them all), `kept` the next beams, best first."""

    finished: list[tuple[int, int]] = field(default_factory=list)
    kept: list[tuple[int, int]] = field(default_factory=list)


def choose(cum: torch.Tensor, lps: torch.Tensor, ids: torch.Tensor, width: int,
           eos: int | None) -> StepChoice:
    """The group's next beams: the `width` best non-EOS candidates by cumulative logprob over
    all beams' [B, 2*width] candidates (`lps`, `ids`), and the EOS candidates (`eos` None:
    ignore_eos). All beams have one length, so the length penalty keeps this order."""
    total = cum.to(lps.dtype).unsqueeze(1) + lps
    is_eos = ids == eos if eos is not None else torch.zeros_like(ids, dtype=torch.bool)
    masked = total.masked_fill(is_eos, float("-inf")).flatten()
    k = min(width, int((~is_eos).sum()))
    top = masked.topk(k).indices.tolist() if k else []
    cols = lps.shape[1]
    out = StepChoice(kept=[(i // cols, i % cols) for i in top])
    out.finished = [tuple(p) for p in is_eos.nonzero().tolist()]  # type: ignore[misc]
    return out


def candidate_entry(vals: list[float], ids: list[int]) -> dict[int, Logprob]:
    """A step's logprobs entry as vLLM's beam search keeps it: the candidates ranked 1..2k."""
    return {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(ids, vals))}

"""vLLM's beam search fields on /v1/completions and /v1/chat/completions (`use_beam_search`,
`n` beams, `length_penalty`): checked here and turned into the engine's beam params
(engine/sample/beam_search.py). As vLLM's serving, the `n` best beams come back best first, in
one output (a stream gets them in one chunk per choice, then its end)."""

from __future__ import annotations

from typing import Any

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sample.beam_search import MAX_BEAM_WIDTH, BeamParams, beam_params


def check_beam(req: Any) -> None:
    """400 naming the field for a beam search this server cannot run as asked."""
    if req.use_beam_search not in (None, True, False):
        raise InvalidRequestError("use_beam_search must be a boolean", param="use_beam_search")
    lp = req.length_penalty
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, (int, float))):
        raise InvalidRequestError("length_penalty must be a number", param="length_penalty")
    if not req.use_beam_search:
        if lp not in (None, 1.0):  # as vLLM: it only weighs beams
            raise InvalidRequestError("length_penalty needs use_beam_search", "length_penalty")
        return
    if not 1 <= req.n <= MAX_BEAM_WIDTH:
        raise InvalidRequestError(f"with use_beam_search, n (the beam width) must be in "
                                  f"[1, {MAX_BEAM_WIDTH}], got {req.n}", param="n")
    for name, asked in (("stop", req.stop), ("continuation", req.continuation),
                        ("structured outputs", req.constraint())):
        if asked:
            raise InvalidRequestError(f"{name} cannot be combined with use_beam_search",
                                      param=name.split()[0])


def beam_sampling_params(req: Any, max_tokens: int) -> BeamParams:
    """The engine's params of the request's beam search (`check_beam` passed)."""
    lp = 1.0 if req.length_penalty is None else float(req.length_penalty)
    return beam_params(req.n, max_tokens, req.ignore_eos, lp, req.skip_special_tokens)

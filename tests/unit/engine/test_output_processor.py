"""OutputProcessor (output processing in the engine's process) on hand-built core request states:
cumulative outputs with the text its trackers made, no token still on the device, best_of's
choice only once every candidate is done, an abort as a finished output, prompt logprobs."""

from __future__ import annotations

import pytest
from kvserve.engine.async_scheduling import PLACEHOLDER
from kvserve.engine.core.request import RequestState
from kvserve.engine.core.sequence import Sequence, SequenceStatus
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestMetrics
from kvserve.engine.sample.best_of import expand
from kvserve.engine.sample.detokenizer import NoText
from kvserve.engine.sample.sampling_params import SamplingParams
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def output(tiny_model_dir):
    return OutputProcessor(AutoTokenizer.from_pretrained(tiny_model_dir))


def state_of(output, prompt_ids, params, outputs, best_of=None, makes_text=True):
    """A request state as the core holds it, its samples' text tracked as the core's update
    does (one `update` per token)."""
    seqs, detoks = [], []
    for i, ids in enumerate(outputs):
        seq = Sequence(i + 1, "r", i, prompt_ids, params)
        text = output.new_text(prompt_ids, params, makes_text)
        for k in range(len(ids)):
            seq.output_token_ids = ids[: k + 1]
            text.update(seq.output_token_ids)
        seqs.append(seq)
        detoks.append(text)
    return RequestState("r", None, prompt_ids, params, seqs, detoks, RequestMetrics(0.0),
                        best_of=best_of)


def finish(seq, reason="length", cumulative=0.0):
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
    seq.cumulative_logprob, seq.logprobs = cumulative, [{}]  # a logprob: the ranking reads it


def test_text_is_the_trackers_and_a_token_in_flight_is_not_shown(output):
    tok = output.tokenizer
    ids = tok("Paged attention stores blocks")["input_ids"]
    params = SamplingParams(max_tokens=8)
    state = state_of(output, [1], params, [ids])
    state.seqs[0].output_token_ids = ids + [PLACEHOLDER]  # the next step's token, on the device
    out = output.make_output(state)
    assert out.outputs[0].token_ids == ids and not out.finished
    assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=True)
    quiet = output.make_output(state_of(output, [1], params, [ids], makes_text=False))
    assert quiet.outputs[0].text == "" and isinstance(output.new_text([1], params, False), NoText)


def test_best_of_shows_nothing_until_done_then_the_best_n(output):
    params, best = expand(SamplingParams(n=1, best_of=3, max_tokens=2))
    state = state_of(output, [1], params, [[5, 6], [7, 8], [9, 10]], best_of=best)
    for seq, lp in zip(state.seqs[:2], (-3.0, -1.0)):
        finish(seq, cumulative=lp)
    assert output.make_output(state).outputs == [] and not output.make_output(state).finished
    finish(state.seqs[2], cumulative=-2.0)
    (best_out,) = output.make_output(state).outputs
    assert best_out.token_ids == [7, 8] and best_out.index == 0


def test_an_abort_is_a_finished_output_and_prompt_logprobs_come_along(output):
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    state = state_of(output, [3], params, [[4]])
    state.seqs[0].finish_reason = "abort"
    out = output.make_output(state)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.prompt_logprobs == [None]  # a one-token prompt has no scored position

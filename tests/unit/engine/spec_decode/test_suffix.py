"""The suffix-decoding proposer: drafts from the stream itself and from recent outputs."""

from __future__ import annotations

import numpy as np

from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.proposer import ProposerContext, SpecRequestView
from kvserve.engine.spec_decode.registry import make_proposer, proposer_class
from kvserve.engine.spec_decode.suffix import SuffixProposer


def _proposer(max_model_len: int = 4096, **fields) -> SuffixProposer:
    config = SpeculativeConfig(method="suffix", **fields)
    proposer = make_proposer(config, ProposerContext(vocab_size=1000, max_model_len=max_model_len))
    assert isinstance(proposer, SuffixProposer)
    return proposer


def _view(rid: str, prompt: list[int], output: list[int]) -> SpecRequestView:
    return SpecRequestView(rid, np.array(prompt + output, dtype=np.int64), len(prompt))


def test_registered_under_suffix():
    assert proposer_class("suffix") is SuffixProposer


def test_drafts_the_continuation_of_text_in_the_prompt():
    text = list(range(100, 140))
    prompt = [1, 2, 3] + text + [7, 8, 9]
    proposer = _proposer(num_speculative_tokens=5)
    # The output has started copying the text: the next tokens are the text's next ones.
    assert proposer.propose([_view("a", prompt, text[:6])], 5) == [text[6:11]]
    assert proposer.propose([_view("a", prompt, text[:12])], 5) == [text[12:17]]


def test_a_repeated_request_drafts_the_earlier_output_from_its_first_step():
    prompt = list(range(500, 530))
    answer = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    proposer = _proposer(num_speculative_tokens=4)
    for i in range(1, len(answer) + 1):  # the first request decodes its answer
        proposer.propose([_view("first", prompt, answer[:i])], 4)
    proposer.release("first")
    assert proposer.cache.active_streams == []
    assert proposer.propose([_view("again", prompt, answer[:1])], 4) == [answer[1:5]]


def test_cache_evicts_first_in_first_out():
    proposer = _proposer(num_speculative_tokens=4, suffix_decoding_max_cached_requests=1)
    prompt, answer = [900, 901, 902], [31, 32, 33, 34, 35, 36]
    proposer.propose([_view("old", prompt, answer)], 4)
    proposer.release("old")
    proposer.propose([_view("other", [1, 1, 1], [2])], 4)
    proposer.release("other")
    assert proposer.cache.cached_streams == ["other"]
    assert proposer.propose([_view("new", prompt, answer[:1])], 4) == [[]]


def test_no_global_cache_when_zero():
    proposer = _proposer(num_speculative_tokens=4, suffix_decoding_max_cached_requests=0)
    prompt, answer = [900, 901, 902], [31, 32, 33, 34, 35, 36]
    proposer.propose([_view("old", prompt, answer)], 4)
    proposer.release("old")
    assert proposer.propose([_view("new", prompt, answer[:1])], 4) == [[]]


def test_drafts_respect_num_tokens_and_max_model_len():
    text = list(range(100, 140))
    proposer = _proposer(max_model_len=50, num_speculative_tokens=8)
    prompt = text + [5]
    # 41 prompt + 6 output = 47 tokens; room for 50 - 47 - 1 = 2 drafts.
    assert proposer.propose([_view("a", prompt, text[:6])], 8) == [text[6:8]]
    assert proposer.propose([_view("b", text, text[:2])], 1) == [text[2:3]]


def test_batch_keeps_streams_apart_and_restarts_a_shrunk_stream():
    proposer = _proposer(num_speculative_tokens=3)
    a = _view("a", [1, 2, 3, 4, 5, 6, 7], [1, 2])
    b = _view("b", [9, 8, 7, 6, 5, 4], [9, 8])
    assert proposer.propose([a, b], 3) == [[3, 4], [7, 6]]
    # A stream shorter than what the proposer saw (recomputed elsewhere) is rebuilt, not extended.
    assert proposer.propose([_view("a", [1, 2, 3, 4, 5, 6, 7], [1])], 3) == [[2]]

"""The default model (SmolLM2-135M-Instruct, fp32) with n-gram speculation: greedy output is
token-identical to plain decoding, and on a summary that reuses its text's words most drafts
are accepted."""

from __future__ import annotations

import pytest
from spec_checks import plain_and_ngram

from kvserve import SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("Paged attention stores the key and value vectors of every request in fixed-size "
        "blocks, so the cache of a long conversation does not need one contiguous region of "
        "memory. The scheduler allocates blocks as tokens arrive and frees them when a request "
        "ends.")
CHATS = [[{"role": "user", "content": f"Summarise this text in three sentences, reusing its own "
                                      f"words:\n\n{TEXT}"}],
         [{"role": "user", "content": "What is the capital of France?"}]]


def test_greedy_ngram_equals_plain_decoding(default_model_dir):
    ref, got, spec = plain_and_ngram(default_model_dir, CHATS,
                                     SamplingParams(temperature=0, max_tokens=48))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    stats = spec.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 3

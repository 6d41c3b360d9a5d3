"""The real default model (9 query / 3 KV heads) over 3 tensor-parallel ranks: greedy output
token-identical to one rank in fp32."""

from __future__ import annotations

import pytest
from forked_workers import forked_workers

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """The three ranks fork from a preloaded fork server (forked_workers.py): no import of torch
    and transformers each."""
    with forked_workers():
        yield


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain the multi-head attention mechanism in the Transformer architecture",
             "What is the difference between PagedAttention and traditional KV cache management?"]


def answers(tp: int) -> list[list[int]]:
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=1024,
              kv_cache_memory=1 << 27, tensor_parallel_size=tp)
    try:
        convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_three_ranks_give_the_tokens_of_one(default_model_dir) -> None:
    expected = answers(1)
    assert answers(3) == expected

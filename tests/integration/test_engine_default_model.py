"""The real default model (SmolLM2-135M-Instruct) through `LLM`: greedy output token-identical to
HF transformers `generate` in fp32, one prompt at a time and all batched together."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Explain the multi-head attention mechanism in the Transformer architecture",
    "How can the GPU memory efficiency of large model inference be optimised?",
    "What is the difference between PagedAttention and traditional KV cache management?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def chats(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                    add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_reference(default_model_dir, chats):
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    out = []
    for ids in chats:
        x = torch.tensor([list(ids)])
        gen = hf.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False)  # stops at EOS
        out.append(gen[0, x.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=1024,
               kv_cache_memory=1 << 28)


def test_greedy_equals_hf_one_at_a_time_and_batched(llm, chats, hf_reference):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)  # stops at EOS, as HF does
    one = [llm.generate([list(c)], params, use_tqdm=False)[0].outputs[0].token_ids
           for c in chats]
    batched = [o.outputs[0].token_ids
               for o in llm.generate([list(c) for c in chats], params, use_tqdm=False)]
    assert one == hf_reference
    assert batched == hf_reference
    assert sum(map(len, hf_reference)) >= 6 * NEW_TOKENS  # most answers run the full length



def test_prompt_logprobs_equal_hf_log_softmax(llm, chats, default_model_dir):
    """SamplingParams(prompt_logprobs=3) on the real model: the actual token's logprob and the
    top-3 at every prompt position equal HF's fp32 log_softmax (one batch of all the chats)."""
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    outs = llm.generate([list(c) for c in chats[:4]],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                        use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for j in range(1, len(ids)):
            entry = out.prompt_logprobs[j]
            assert entry[ids[j]].logprob == pytest.approx(float(ref[j - 1, ids[j]]), abs=2e-3)
            top = sorted((e for e in entry.values() if e.rank <= 3), key=lambda e: e.rank)
            assert [e.logprob for e in top] == pytest.approx(ref[j - 1].topk(3).values.tolist(),
                                                             abs=2e-3)

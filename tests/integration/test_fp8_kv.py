"""FP8 KV cache end to end on the default model (SmolLM2-135M-Instruct, fp32 weights, CPU).

Measured here (docs/perf.md): free-running greedy output with the e4m3 cache matches the fp32
cache on only ~45-75% of the first 32 positions (one early flip changes everything after it);
running the whole model in bf16 scores 73.9% on the same measure (bench/fp8_quality.py), so a
free-running 90% is beyond even bf16 weights on this model. What is asserted instead: the fp8 run
is token-identical to an fp32 cache fed K/V rounded through e4m3 (so the kernels store and read
e4m3 exactly and the loss is e4m3's 3 mantissa bits), and given the same history (teacher
forcing) the fp8 cache picks the fp32 cache's greedy token at >= 90% of positions.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kernels import write_kv as write_kv_module
from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.reference import dequantize, quantize

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Explain the multi-head attention mechanism in the Transformer architecture",
    "Write a haiku about the sea.",
    "How can the GPU memory efficiency of large model inference be optimised?",
    "List three prime numbers and say why they are prime.",
    "Who wrote Romeo and Juliet?",
]
NEW_TOKENS = 32


def make_llm(**kwargs) -> LLM:
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=512,
               kv_cache_memory=1 << 27, **kwargs)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def positional_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra[:NEW_TOKENS], rb[:NEW_TOKENS]))
    return same / (len(a) * NEW_TOKENS)


def teacher_forced_agreement(llm: LLM, chats: list[list[int]], ref: list[list[int]]) -> float:
    """Share of positions where `llm`'s greedy next token, given the reference history, is the
    reference token: every (prompt, position) is one max_tokens=1 request in one batch."""
    histories = [chat + r[:i] for chat, r in zip(chats, ref) for i in range(NEW_TOKENS)]
    targets = [r[i] for r in ref for i in range(NEW_TOKENS)]
    got = [out[0] for out in greedy(llm, histories, max_tokens=1)]
    return sum(g == t for g, t in zip(got, targets)) / len(targets)


@pytest.fixture(scope="module")
def fp32_llm():
    return make_llm()


@pytest.fixture(scope="module")
def chats(fp32_llm):
    tok = fp32_llm.get_tokenizer()
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False))
            for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(fp32_llm, chats):
    return greedy(fp32_llm, chats)


@pytest.fixture(scope="module")
def fp8_llm():
    return make_llm(kv_cache_dtype="fp8")


def test_fp8_budget_holds_four_times_the_fp32_blocks(fp32_llm, fp8_llm):
    fp32, fp8 = fp32_llm.llm_engine.memory_budget, fp8_llm.llm_engine.memory_budget
    assert fp8.bytes_per_block * 4 == fp32.bytes_per_block
    assert fp8.num_blocks >= 4 * fp32.num_blocks - 4


def test_fp8_equals_an_fp32_cache_holding_e4m3_rounded_values(fp8_llm, chats, monkeypatch):
    fp8_out = greedy(fp8_llm, chats)
    real_write = write_kv_module.write_kv

    def rounded_write(key, value, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0, **kw):
        def rnd(x, s):
            return dequantize(quantize(x, s, FP8_DTYPE), s, x.dtype)
        real_write(rnd(key, k_scale), rnd(value, v_scale), k_cache, v_cache, slots, **kw)

    # the model resolves it at build
    monkeypatch.setattr(write_kv_module, "write_kv", rounded_write)
    fake = greedy(make_llm(), chats)
    assert fake == fp8_out


@pytest.mark.parametrize("calibrate", [False, True], ids=["scale-1.0", "calibrated"])
def test_fp8_agreement_with_the_fp32_cache(fp8_llm, chats, reference, calibrate):
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True) if calibrate else fp8_llm
    free = positional_agreement(greedy(llm, chats), reference)
    forced = teacher_forced_agreement(llm, chats, reference)
    print(f"\nfp8 KV ({'calibrated scales' if calibrate else 'scale 1.0'}): free-running greedy "
          f"agrees on {free:.1%} of the first {NEW_TOKENS} positions; teacher-forced {forced:.1%}")
    assert forced >= 0.90

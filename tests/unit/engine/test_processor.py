"""Processor (input processing) against a real EngineCore on the tiny random Llama: what it hands
the core (tokens, capped params, best_of expanded, a fresh text tracker per call), and that a
request it refuses leaves the core untouched."""

from __future__ import annotations

import pytest
from kvserve.engine.config import EngineConfig
from kvserve.engine.core.engine_core import EngineCore
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.processor import Processor
from kvserve.engine.sample.detokenizer import NoText
from kvserve.engine.sample.sampling_params import SamplingParams

# The tiny Llama's block: 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes x 16 tokens.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16


def make_processor(model_dir, kv_cache_memory: int) -> Processor:
    core = EngineCore(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                   kv_cache_memory=kv_cache_memory, max_model_len=64,
                                   max_num_seqs=4))
    return Processor(core, OutputProcessor(core.tokenizer).new_text)


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    return make_processor(tiny_model_dir, 1 << 20)


def test_a_text_prompt_is_tokenized_and_max_tokens_capped_without_aliasing(processor):
    params = SamplingParams(max_tokens=None, temperature=0)
    req = processor.process("a", "Hello world", params)
    assert req.prompt == "Hello world"
    assert req.prompt_token_ids == processor.core.tokenizer("Hello world")["input_ids"]
    assert req.params.max_tokens == 64 - len(req.prompt_token_ids)  # the context's rest
    assert params.max_tokens is None and req.params is not params  # the caller's stay as sent
    a, b = req.new_text(), req.new_text()
    assert a is not b and not isinstance(a, NoText)  # one tracker per sample, forks included


def test_best_of_runs_every_candidate_and_the_core_client_case_keeps_text(processor):
    req = processor.process("b", [1, 2, 3], SamplingParams(n=1, best_of=3, max_tokens=4),
                            detokenize=False)
    assert req.params.n == 3 and req.best_of is not None and req.best_of.n == 1
    assert req.makes_text and not isinstance(req.new_text(), NoText)  # best_of ranks texts here
    plain = processor.process("c", [1, 2, 3], SamplingParams(max_tokens=4), detokenize=False)
    assert not plain.makes_text and isinstance(plain.new_text(), NoText)


@pytest.mark.parametrize("prompt, params, param", [
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([10**7], SamplingParams(max_tokens=4), "prompt"),
    (list(range(1, 65)), SamplingParams(max_tokens=4), "prompt"),
    ([1, 2], SamplingParams(max_tokens=4, n=5), "n"),
    ([1, 2], SamplingParams(max_tokens=4, logit_bias={10**7: 1.0}), "logit_bias"),
])
def test_refusals_name_the_parameter_and_leave_the_core_untouched(processor, prompt, params,
                                                                   param):
    with pytest.raises(InvalidRequestError) as err:
        processor.process("bad", prompt, params)
    assert err.value.param == param
    assert not processor.core.requests and processor.core.prompt_tokens == 0


def test_an_id_in_use_is_refused(processor):
    processor.core.add_request(processor.process("dup", [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequestError) as err:
        processor.process("dup", [3, 4], SamplingParams(max_tokens=2))
    assert err.value.param == "request_id"
    processor.core.abort_requests(["dup"])
    processor.core.step()  # hands the aborted request back: the core is empty again
    assert not processor.core.requests and not processor.core.pending


def test_kv_cache_too_small_for_the_request_and_engine_wide_rules(processor, tiny_model_dir):
    small = make_processor(tiny_model_dir, 3 * BLOCK_BYTES)  # 48 token slots, a 64-token context
    assert small.core.memory_budget.num_blocks * small.core.block_size == 48
    assert small.process("fits", [1] * 8, SamplingParams(max_tokens=40)).params.max_tokens == 40
    with pytest.raises(InvalidRequestError, match="KV") as err:  # fits the context, not the cache
        small.process("big", [1] * 8, SamplingParams(max_tokens=41))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        processor.process("p", [1, 2], SamplingParams(max_tokens=4), priority=1)
    assert err.value.param == "priority"
    with pytest.raises(InvalidRequestError) as err:
        processor.process("l", [1, 2], SamplingParams(max_tokens=4), lora_request=object())
    assert err.value.param == "lora_request"

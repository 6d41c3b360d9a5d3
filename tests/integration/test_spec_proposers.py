"""The suffix, draft-model and EAGLE proposers inside the engine, against the same engine without
speculation (tiny random Llama, fp32, greedy): token-identical outputs; the target as its own
draft has every draft accepted; a repeated request is drafted from the suffix cache."""

from __future__ import annotations

import pytest
from conftest import build_tiny_llama, make_llm
from transformers import AutoConfig

from kvserve import SamplingParams
from kvserve.engine.spec_decode.eagle_head import write_random_head

PROMPTS = ["the cat sat on the mat and the cat sat on the", "hello world, hello world,",
           "a b c d e f g"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # 8 layers: EAGLE-3 reads the states entering layers 2, 4 and 5.
    return build_tiny_llama(tmp_path_factory.mktemp("spec") / "t", num_hidden_layers=8)


@pytest.fixture(scope="module")
def reference(target):
    return [o.outputs[0].token_ids for o in make_llm(target).generate(PROMPTS, GREEDY,
                                                                       use_tqdm=False)]


def _run(target, config, prompts=PROMPTS):
    llm = make_llm(target, speculative_config=config)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return llm, out


def _counts(llm):
    s = llm.llm_engine.get_stats()
    return s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


def test_target_as_its_own_draft_is_always_accepted(target, reference):
    llm, out = _run(target, {"method": "draft_model", "model": str(target),
                             "num_speculative_tokens": 3, "adaptive": False})
    assert out == reference
    drafted, accepted = _counts(llm)
    assert drafted > 0 and accepted == drafted


def test_suffix_drafts_a_repeated_request_from_its_cache(target, reference):
    llm = make_llm(target, speculative_config={"method": "suffix", "adaptive": False,
                                               "num_speculative_tokens": 4})
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert first == reference
    drafted0, accepted0 = _counts(llm)
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)]
    assert again == reference[:1]
    drafted, accepted = _counts(llm)
    # The repeat's 32 tokens: the cached output is drafted from its first decode step on.
    assert accepted - accepted0 >= 24
    assert accepted - accepted0 == drafted - drafted0


@pytest.mark.parametrize("eagle3", [True, False])
def test_eagle_heads_keep_outputs_exact(target, reference, tmp_path, eagle3):
    cfg = AutoConfig.from_pretrained(target)
    head = write_random_head(tmp_path / "head", cfg, eagle3=eagle3,
                             draft_vocab_size=200 if eagle3 else None, std=0.3)
    llm, out = _run(target, {"method": "eagle3" if eagle3 else "eagle", "model": str(head),
                             "num_speculative_tokens": 3, "adaptive": False})
    assert out == reference
    drafted, _ = _counts(llm)
    assert drafted > 0  # a random head's acceptance means nothing; it must have drafted

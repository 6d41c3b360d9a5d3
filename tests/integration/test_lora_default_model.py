"""Adapters on the real default model (SmolLM2-135M-Instruct, fp32): three random PEFT adapters
(A and B random) on q/k/v/o/gate/up/down, one batch mixing them with the base model and
max_loras 2 < 3 adapters; greedy tokens and teacher-forced logprobs against HF + peft (merged)."""

from __future__ import annotations

import pytest
import torch

from family_checks import assert_matches_hf
from kvserve import LLM, SamplingParams
from kvserve.lora.request import LoRARequest
from lora_checks import build_adapter, merged_model

pytestmark = pytest.mark.slow  # about 30 s idle, minutes under load (HF + peft loads 4 models)

TOKENS = 4


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory):
    """Three random rank-8 adapters of the default model on all seven projections, large
    enough that every adapter changes the greedy tokens; the second uses rsLoRA."""
    root = tmp_path_factory.mktemp("default-lora")
    return [build_adapter(default_model_dir, root / f"a{i}", seed=100 + i, rslora=rslora,
                          scale=0.04) for i, rslora in enumerate((False, True, False))]


def test_mixed_adapters_on_the_default_model_match_hf_peft_merged(default_model_dir, adapters):
    gen = torch.Generator().manual_seed(3)
    token_prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (7, 12)]
    reqs = [None, *(LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters))]
    items = [p for p in token_prompts for _ in reqs]
    loras = [r for _ in token_prompts for r in reqs]
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory=1 << 24, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in items],
                            SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=1,
                                           ignore_eos=True), use_tqdm=False, lora_request=loras)
    finally:
        llm.shutdown()
    for k, req in enumerate(reqs):
        hf = merged_model(default_model_dir, adapters[k - 1] if req is not None else None)
        assert_matches_hf(hf, token_prompts, outs[k::len(reqs)], atol=1e-3)
    by_adapter = {str([o.outputs[0].token_ids for o in outs[k::len(reqs)]])
                  for k in range(len(reqs))}
    assert len(by_adapter) == len(reqs)  # each adapter changes the tokens: the op was applied

"""The draft-model proposer against HF transformers: with the target as its own draft, every
draft is the target's greedy continuation, across accepted and rejected drafts (the cache is
rolled back) and a pool that has to grow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama
from transformers import AutoModelForCausalLM

from kvserve.engine.errors import ConfigError
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.draft_kv import DraftKV
from kvserve.engine.spec_decode.draft_model import DraftModelProposer
from kvserve.engine.spec_decode.proposer import ProposerContext, SpecRequestView
from kvserve.engine.spec_decode.registry import make_proposer, proposer_class

K = 4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("draft") / "target")


@pytest.fixture(scope="module")
def hf(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _proposer(path, vocab: int = 387) -> DraftModelProposer:
    config = SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=K)
    context = ProposerContext(vocab_size=vocab, max_model_len=512,
                              device=torch.device("cpu"), dtype=torch.float32)
    proposer = make_proposer(config, context)
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def _view(rid: str, prompt: list[int], output: list[int]) -> SpecRequestView:
    return SpecRequestView(rid, np.array(prompt + output, dtype=np.int64), len(prompt))


def test_registered():
    assert proposer_class("draft_model") is DraftModelProposer


def test_target_as_draft_proposes_its_greedy_continuation(target_dir, hf):
    proposer = _proposer(target_dir, hf.config.vocab_size)
    prompt = [5, 17, 42, 99, 3, 250, 8, 61, 77]
    cont = _greedy(hf, prompt, 16)
    assert proposer.propose([_view("a", prompt, cont[:1])], K) == [cont[1:5]]
    # All four accepted plus the target's own: the cache keeps the drafts it wrote.
    assert proposer.propose([_view("a", prompt, cont[:6])], K) == [cont[6:10]]
    # Only the first accepted, then a token other than the draft: the rest is rolled back.
    other = (cont[8] + 1) % hf.config.vocab_size
    out = cont[:7] + [other]
    assert proposer.propose([_view("a", prompt, out)], K) == [_greedy(hf, prompt + out, K)]


def test_batch_of_streams_and_a_growing_pool(target_dir, hf):
    proposer = _proposer(target_dir, hf.config.vocab_size)
    proposer.kv = DraftKV(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                          device=torch.device("cpu"), initial_blocks=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in (40, 3, 70)]
    views = [_view(f"s{i}", p, []) for i, p in enumerate(prompts)]
    got = proposer.propose(views, K)
    assert got == [_greedy(hf, p, K) for p in prompts]
    assert proposer.kv.num_blocks >= sum(-(-(len(p) + K - 1) // 16) for p in prompts)
    free_before = len(proposer.kv.free_blocks)
    proposer.release("s2")
    assert len(proposer.kv.free_blocks) == free_before + 5  # 70 + 3 positions: 5 blocks
    # A stream that reached the length limit gets no drafts; max_model_len is 512.
    assert proposer.propose([_view("long", [1] * 510, [2])], K) == [[]]


def test_a_different_draft_gives_valid_ids(tmp_path, hf):
    draft = build_tiny_llama(tmp_path / "draft", seed=7, num_hidden_layers=1)
    proposer = _proposer(draft, hf.config.vocab_size)
    out = proposer.propose([_view("a", [1, 2, 3], [4]), _view("b", [9] * 20, [])], K)
    assert [len(d) for d in out] == [K, K]
    assert all(0 <= t < hf.config.vocab_size for d in out for t in d)


def test_refuses_a_draft_of_another_vocabulary(tmp_path):
    draft = build_tiny_llama(tmp_path / "small-vocab", vocab_size=50)
    with pytest.raises(ConfigError, match="the target's tokenizer"):
        _proposer(draft, vocab=387)
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size"):
        make_proposer(SpeculativeConfig(method="draft_model", model=str(draft),
                                        num_speculative_tokens=2, draft_tensor_parallel_size=2),
                      ProposerContext(vocab_size=50, max_model_len=64))

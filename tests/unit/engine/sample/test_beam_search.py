"""Beam search (engine/sample/beam_search.py, engine/core/beam_group.py) against HF transformers'
`generate(num_beams=k)` on tiny random models of two families (fp32), and against a written-out
copy of vLLM's `LLM.beam_search` loop where vLLM and HF differ (EOS candidates, the length
penalty's length); the beams share the prompt's blocks."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm
from family_checks import build_family, hf_model, prompts
from kvserve.engine.sample.beam_search import BeamSearchParams, beam_score, choose

CASES = [(2, 5, 0.0), (3, 4, 1.0), (4, 6, 2.0)]  # (width, max_tokens, length_penalty)


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM"])
def family(request, tmp_path_factory):
    path = build_family(tmp_path_factory.mktemp("beam") / "m", request.param,
                        max_position_embeddings=2048)
    llm = make_llm(path, block_size=8, max_model_len=1100)
    yield path, hf_model(path), llm
    llm.shutdown()


def _search(llm, prompt, width, tokens, **kw):
    params = BeamSearchParams(beam_width=width, max_tokens=tokens, **kw)
    return llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences


@pytest.mark.parametrize("width,tokens,penalty", CASES)
def test_beams_equal_hf_generate(family, width, tokens, penalty):
    """No EOS in play (ignore_eos; HF without one): every beam runs max_tokens, so vLLM's and
    HF's rules agree on the beams; HF's score divides by the output length, vLLM's by prompt +
    output, hence the cumulative logprobs are compared."""
    _, hf, llm = family
    for prompt in prompts(hf.config.vocab_size, (6, 13)):
        ours = _search(llm, prompt, width, tokens, ignore_eos=True, length_penalty=penalty)
        ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=tokens, length_penalty=penalty,
                          early_stopping="never", eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True)
        assert [s.tokens for s in ours] == ref.sequences.tolist()
        torch.testing.assert_close(torch.tensor([s.cum_logprob for s in ours], dtype=torch.float64),
                                   ref.sequences_scores.double() * tokens ** penalty,
                                   atol=2e-4, rtol=0)
        for s in ours:  # vLLM's score over prompt + output, best first
            assert s.text == llm.get_tokenizer().decode(s.tokens)
        scores = [beam_score(len(s.tokens), s.cum_logprob, False, penalty) for s in ours]
        assert scores == sorted(scores, reverse=True)


def vllm_reference(hf, prompt, width, max_tokens, eos, penalty):
    """vLLM's `LLM.beam_search` written out: each beam's top 2 * width candidates, every EOS
    candidate completed, the `width` best others kept, `max_tokens` steps, no early stop."""
    def score(beam):
        tokens, cum = beam
        return beam_score(len(tokens), cum, tokens[-1] == eos, penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        new = []
        for tokens, cum in beams:
            with torch.no_grad():
                logp = hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            vals, ids = logp.topk(2 * width)
            for v, t in zip(vals.tolist(), ids.tolist()):
                (completed if t == eos else new).append((tokens + [t], cum + v))
        beams = sorted(new, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A tiny model whose EOS is often among the candidates: its output row is another token's,
    scaled, so beams end on EOS at different lengths."""
    path = build_family(tmp_path_factory.mktemp("beam_eos") / "m", "Qwen3ForCausalLM")
    hf = hf_model(path)
    eos = hf.config.eos_token_id
    with torch.no_grad():
        w = hf.get_output_embeddings().weight
        w[eos] = 0.97 * w[hf(torch.tensor([prompts(len(w), (6,))[0]])).logits[0, -1].argmax()]
    hf.save_pretrained(path)
    llm = make_llm(path, block_size=8)
    yield hf, llm, eos
    llm.shutdown()


@pytest.mark.parametrize("width,tokens,penalty", [(2, 6, 1.0), (3, 8, 0.5), (4, 7, 2.0)])
def test_eos_follows_vllm_not_hf(eos_model, width, tokens, penalty):
    """With EOS in play vLLM keeps every EOS candidate and scores over prompt + output without
    the EOS; the engine's beams are that loop's, token for token and score for score."""
    hf, llm, eos = eos_model
    ended = 0
    for prompt in prompts(hf.config.vocab_size, (6, 9)):
        ours = _search(llm, prompt, width, tokens, length_penalty=penalty)
        ref = vllm_reference(hf, prompt, width, tokens, eos, penalty)
        assert [s.tokens for s in ours] == [t for t, _ in ref]
        torch.testing.assert_close(torch.tensor([s.cum_logprob for s in ours], dtype=torch.float64),
                                   torch.tensor([c for _, c in ref], dtype=torch.float64),
                                   atol=2e-4, rtol=0)
        for s in ours:
            assert s.finish_reason == ("stop" if s.tokens[-1] == eos else "length")
            assert len(s.logprobs) == len(s.tokens) - len(prompt)
            assert all(len(entry) == 2 * width for entry in s.logprobs)
        ended += sum(s.tokens[-1] == eos for s in ours)
    assert ended > 0  # the EOS rule was exercised


def test_choose_keeps_every_eos_and_the_best_others():
    cum = torch.tensor([0.0, -1.0], dtype=torch.float64)
    lps = torch.tensor([[-0.1, -0.5, -2.0, -3.0], [-0.2, -0.3, -0.4, -9.0]], dtype=torch.float64)
    ids = torch.tensor([[7, 2, 5, 6], [2, 8, 9, 1]])
    choice = choose(cum, lps, ids, width=2, eos=2)
    assert sorted(choice.finished) == [(0, 1), (1, 0)]  # every EOS, ranked or not
    assert choice.kept == [(0, 0), (1, 1)]  # -0.1, then -1.3 beats -2.0
    assert choose(cum, lps, ids, width=2, eos=None).kept == [(0, 0), (0, 1)]  # ignore_eos


def test_score_leaves_a_final_eos_out():
    assert beam_score(10, -5.0, False, 1.0) == -0.5
    assert beam_score(11, -5.0, True, 1.0) == -0.5
    assert beam_score(4, -2.0, False, 0.0) == -2.0


@pytest.mark.slow
def test_default_model_beams_equal_hf_generate(default_model_dir):
    """The default model (fp32): width 3, 6 tokens, no EOS in play, as HF's beam search."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    llm = make_llm(default_model_dir, max_model_len=512, kv_cache_memory=64 << 20)
    try:
        prompt = llm.get_tokenizer().encode("The capital of France is")
        ours = _search(llm, prompt, 3, 6, ignore_eos=True, length_penalty=1.0)
    finally:
        llm.shutdown()
    ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3,
                      do_sample=False, max_new_tokens=6, early_stopping="never",
                      eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                      output_scores=True)
    assert [s.tokens for s in ours] == ref.sequences.tolist()
    torch.testing.assert_close(torch.tensor([s.cum_logprob for s in ours], dtype=torch.float64),
                               ref.sequences_scores.double() * 6, atol=1e-3, rtol=0)

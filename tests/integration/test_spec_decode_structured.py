"""Speculative decoding under structured outputs (tiny random Llama, fp32, both grammar
backends): requests under a JSON schema, a regex, a choice or an EBNF grammar get drafts,
scored and accepted (the counters move: no silent fallback to plain decoding), with the same
greedy and seeded tokens as without speculation; drafts the grammar refuses are cut before they
are scored, and even when they are not, the verification (each position masked by the grammar
after the drafts before it) never keeps one; sampled outputs stay valid."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import jsonschema
import pytest
from conftest import make_llm
from spec_checks import plain_and_ngram

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.engine.spec_decode import speculator
from kvserve.engine.spec_decode.proposer import Proposer, SpecRequestView

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
ITEMS = {"type": "array", "items": {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "bird"]}, "id": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
    "required": ["kind", "id"]}, "minItems": 3, "maxItems": 5}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "ok", "tags"]}
REGEX = r"(abc|abd)(-(abc|abd|xyz)){3,6}"
CHOICES = ["the cat sat on the mat", "the dog ran in the park", "hello world hello world"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= "ab" | "cd" | "hello world"'
PROMPTS = ['[{"kind": "cat", "id": 1}, {"kind": "dog", "id": 2}] the cat sat on the mat',
           "hello world, hello world, abc-abd-xyz (ab,cd,ab)",
           "the cat sat on the mat and the cat sat on the", "one two three four"]
CONSTRAINTS = {"json": dict(json=ITEMS), "json2": dict(json=PERSON), "regex": dict(regex=REGEX),
               "choice": dict(choice=CHOICES), "grammar": dict(grammar=GRAMMAR)}


class Oracle(Proposer):
    """Drafts the reference continuation of each stream; every `wrong`-th draft has one token
    replaced by `junk` (refused by the grammars here). Counts the tokens it proposed."""

    method = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], junk: int,
                 wrong: int = 3) -> None:
        self.reference, self.junk, self.wrong = reference, junk, wrong
        self.calls = self.proposed = 0

    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        out = []
        for r in requests:
            self.calls += 1
            tokens = r.token_ids.tolist()
            full = self.reference.get(tuple(tokens[: r.num_prompt_tokens]), [])
            draft = list(full[len(tokens):len(tokens) + num_tokens])
            if draft and self.calls % self.wrong == 0:
                draft[self.calls % len(draft)] = self.junk
            self.proposed += len(draft)
            out.append(draft)
        return out


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def base(tiny_model_dir, backend):
    return make_llm(tiny_model_dir, structured_outputs_config={"backend": backend})


def spec_llm(path, backend, config=None, **kw):
    return make_llm(path, speculative_config=dict(config or NGRAM),
                    structured_outputs_config={"backend": backend}, **kw)


def guided(constraint: str, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 160)  # the longest output any constraint here allows: ~140
    return SamplingParams(structured_outputs=StructuredOutputsParams(**CONSTRAINTS[constraint]),
                          **kw)


def counters(llm) -> tuple[int, int]:
    s = llm.llm_engine.get_stats()
    return s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.text for c in x.outputs] == [c.text for c in y.outputs]
        assert [c.finish_reason for c in x.outputs] == [c.finish_reason for c in y.outputs]


def check(constraint: str, text: str) -> None:
    """The output matches its constraint."""
    c = CONSTRAINTS[constraint]
    if "json" in c:
        jsonschema.validate(json.loads(text), c["json"])
    elif "regex" in c:
        assert re.fullmatch(REGEX, text), text
    elif "choice" in c:
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\((ab|cd|hello world)(,(ab|cd|hello world))*\)", text), text


def with_oracle(llm, base_llm, prompts, params, wrong=3):
    """Point the spec engine's proposer at the base engine's outputs (junk: a '{' token,
    refused inside every constraint here once it has begun)."""
    ref = {}
    for out in base_llm.generate(prompts, params, use_tqdm=False):
        ref[tuple(out.prompt_token_ids)] = list(out.prompt_token_ids) + \
            list(out.outputs[0].token_ids)
    junk = llm.get_tokenizer().encode("{", add_special_tokens=False)[0]
    llm.llm_engine.core.spec.proposer = Oracle(ref, junk, wrong)
    return llm.llm_engine.core.spec.proposer


def assert_no_blocks_held(llm) -> None:
    core = llm.llm_engine.core
    assert not core.scheduler.has_unfinished()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_ngram_greedy_under_a_grammar_equals_plain_decoding(tiny_model_dir, base, backend,
                                                            constraint):
    """Only guided requests run: the accepted drafts are theirs."""
    llm = spec_llm(tiny_model_dir, backend)
    params = guided(constraint)
    ref = base.generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    same(ref, got)
    for out in got:
        assert out.outputs[0].finish_reason == "stop"
        check(constraint, out.outputs[0].text)
    drafted, accepted = counters(llm)
    assert 0 < accepted <= drafted
    assert_no_blocks_held(llm)


def test_refused_drafts_are_cut_before_scoring(tiny_model_dir, base, backend):
    """Oracle drafts with a token the grammar refuses planted in every third: the drafts
    scored are fewer than those proposed, the output is plain decoding's."""
    params = [guided(c) for c in ("json", "json2", "regex", "grammar")]
    llm = spec_llm(tiny_model_dir, backend)
    oracle = with_oracle(llm, base, PROMPTS, params)
    same(base.generate(PROMPTS, params, use_tqdm=False),
         llm.generate(PROMPTS, params, use_tqdm=False))
    drafted, accepted = counters(llm)
    assert 0 < accepted <= drafted < oracle.proposed
    assert_no_blocks_held(llm)


def test_verification_alone_never_keeps_a_refused_draft(tiny_model_dir, base, backend,
                                                        monkeypatch):
    """With the cut before scoring switched off, every proposed draft is scored; the masks of
    the scored positions still make the output plain decoding's, valid."""
    monkeypatch.setattr(speculator, "_grammar_prefix", lambda core, seq, drafts: drafts)
    params = [guided(c) for c in ("json", "json2", "regex", "grammar")]
    llm = spec_llm(tiny_model_dir, backend)
    oracle = with_oracle(llm, base, PROMPTS, params, wrong=2)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    same(base.generate(PROMPTS, params, use_tqdm=False), got)
    for out, c in zip(got, ("json", "json2", "regex", "grammar")):
        check(c, out.outputs[0].text)
    drafted, accepted = counters(llm)
    assert 0 < accepted < drafted == oracle.proposed
    assert_no_blocks_held(llm)


def test_seeded_sampling_under_a_grammar_equals_plain_decoding(tiny_model_dir, base, backend):
    """A seeded row draws each position with plain decoding's uniform, from the masked target
    distribution: the very same tokens and logprobs."""
    params = [guided(c, temperature=1.0, seed=7 + i, logprobs=2)
              for i, c in enumerate(("json", "json2", "regex", "choice"))]
    llm = spec_llm(tiny_model_dir, backend)
    with_oracle(llm, base, PROMPTS, params, wrong=4)
    ref = base.generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    same(ref, got)
    for x, y in zip(ref, got):
        assert [set(e) for e in x.outputs[0].logprobs] == [set(e) for e in y.outputs[0].logprobs]
    assert counters(llm)[1] > 0
    assert_no_blocks_held(llm)


def test_sampled_outputs_stay_valid_with_ngram(tiny_model_dir, backend):
    """Unseeded sampling (T=1) with n-gram drafts: every output validates, and the keys the
    grammar forces are drafted from the output's own repeats and accepted."""
    llm = spec_llm(tiny_model_dir, backend)
    params = [guided(c, temperature=1.0, max_tokens=160, n=2)
              for c in ("json", "json2", "json", "regex")]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, c in zip(outs, ("json", "json2", "json", "regex")):
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            check(c, o.text)
    drafted, accepted = counters(llm)
    assert 0 < accepted <= drafted
    assert_no_blocks_held(llm)


@pytest.mark.slow
def test_default_model_extraction_under_a_schema(default_model_dir, backend):
    """SmolLM2-135M-Instruct (fp32) pulling fields of a given text into a JSON schema: the
    values are copied from the prompt, so n-gram drafts are accepted; tokens equal plain
    decoding's."""
    schema = {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "authors": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["title", "year", "authors"]}
    text = ("Attention Is All You Need, published in 2017 by Ashish Vaswani, Noam Shazeer, "
            "Niki Parmar and Jakob Uszkoreit.")
    chats = [[{"role": "user", "content": f"Extract title, year and authors as JSON from: {text}"}]]
    params = SamplingParams(temperature=0, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json=schema,
                                                                       backend=backend))
    ref, got, spec = plain_and_ngram(default_model_dir, chats, params)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert json.loads(got[0].outputs[0].text)["year"] == 2017
    assert counters(spec)[1] > 0

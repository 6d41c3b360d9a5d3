"""Structured outputs on the tiny random Llama: whatever the (random) model prefers, the grammar
decides what it may say, so every output must validate. Also: unconstrained rows of a mixed batch
are untouched, preemption and forks keep each sequence's matcher right, bad constraints are
refused before they are queued. Every constraint test runs with both backends (xgrammar and
guidance, `gllm`); `llm` (tests/conftest.py) is the default ("auto") engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import make_llm

from kvserve import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.backend import choice_grammar, import_library
from kvserve.engine.structured_output.grammar import GrammarCompiler, apply_token_bitmask

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}},
            "required": ["x", "y"]},
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 4}},
     "required": ["point"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["cat", "dog", None]}}, "required": ["id", "kind"]},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                      "score": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["answer", "score"], "additionalProperties": False},
]
PROMPTS = ["Hello world", "The quick brown fox", "What is the capital of France?",
           "0123456789 abcdefghijklmnopqrstuvwxyz"]
PLAIN = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module", params=BACKENDS)
def gllm(request, tiny_model_dir):
    """An engine whose structured outputs use one backend (--structured-outputs-config.backend)."""
    return make_llm(tiny_model_dir, structured_outputs_config={"backend": request.param})


def guided(max_tokens: int = 160, **kw) -> SamplingParams:
    sampling = {k: kw.pop(k) for k in ("temperature", "seed", "n", "stop") if k in kw}
    sampling.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kw),
                          **sampling)


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_output_validates_and_plain_rows_are_untouched(gllm, sampled):
    plain = [o.outputs[0].token_ids for o in gllm.generate(PROMPTS, PLAIN, use_tqdm=False)]
    extra = dict(temperature=1.0, seed=11) if sampled else {}
    params = [guided(json=s, **extra) for s in SCHEMAS]
    # constrained and unconstrained requests interleaved in one batch
    outs = gllm.generate(PROMPTS + PROMPTS, [PLAIN, params[0], PLAIN, params[1], PLAIN, params[2],
                                            PLAIN, params[3]], use_tqdm=False)
    for i, out in enumerate(outs):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == plain[PROMPTS.index(out.prompt)]
        else:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            check_valid(out.outputs[0].text, SCHEMAS[i // 2])


def test_json_object_regex_and_choice(gllm):
    choices = ["red", "green", "blue and \"quoted\"\n"]
    outs = gllm.generate(PROMPTS[:3], [
        guided(json_object=True, temperature=0.7, seed=1),
        guided(regex=r"[a-z]{3}-\d{2,4}", temperature=1.0, seed=2),
        guided(choice=choices, temperature=1.0, seed=3, n=4)], use_tqdm=False)
    assert isinstance(json.loads(outs[0].outputs[0].text), dict)
    assert re.fullmatch(r"[a-z]{3}-\d{2,4}", outs[1].outputs[0].text)
    assert len(outs[2].outputs) == 4
    assert all(c.text in choices and c.finish_reason == "stop" for c in outs[2].outputs)


def test_forked_siblings_each_follow_their_own_matcher(gllm):
    pattern = r"[a-z]{4}(,[0-9]{2}){2}"
    out = gllm.generate(PROMPTS[0], guided(regex=pattern, temperature=1.5, seed=5, n=6),
                       use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 1  # siblings diverged, and each stayed inside the grammar


def test_both_spellings_and_the_old_one_alone(gllm):
    old = SamplingParams(temperature=0, max_tokens=40,
                         guided_decoding=GuidedDecodingParams(regex=r"(ab|cd){3}"))
    assert re.fullmatch(r"(ab|cd){3}", gllm.generate("x", old, use_tqdm=False)[0].outputs[0].text)
    g = GuidedDecodingParams(choice=["a"])
    SamplingParams(guided_decoding=g, structured_outputs=g)  # the same value twice is fine
    with pytest.raises(InvalidRequestError, match="two names"):
        SamplingParams(guided_decoding=g, structured_outputs=GuidedDecodingParams(choice=["b"]))


def test_stop_string_ends_a_constrained_output(gllm):
    out = gllm.generate("x", guided(regex=r"abc,[a-z]{3}", stop=[","]), use_tqdm=False)[0]
    assert out.outputs[0].text == "abc" and out.outputs[0].stop_reason == ","


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_output_resumes_validly(tiny_model_dir, gllm, mode):
    params = [guided(json=s, max_tokens=70) for s in SCHEMAS]
    expected = [o.outputs[0].text for o in gllm.generate(PROMPTS, params, use_tqdm=False)]
    backend = gllm.llm_engine.config.structured_outputs_backend
    small = make_llm(tiny_model_dir, num_gpu_blocks_override=6, preemption_mode=mode,
                     swap_space=0.01, enable_prefix_caching=False,
                     structured_outputs_backend=backend)
    outs = small.generate(PROMPTS, params, use_tqdm=False)
    assert small.llm_engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == expected
    for out, schema in zip(outs, SCHEMAS):
        check_valid(out.outputs[0].text, schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_kv_cache(tiny_model_dir, backend):
    fp8 = make_llm(tiny_model_dir, kv_cache_dtype="fp8", guided_decoding_backend=backend)
    outs = fp8.generate(PROMPTS, [guided(json=s, temperature=0.8, seed=4) for s in SCHEMAS],
                        use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS):
        check_valid(out.outputs[0].text, schema)


@pytest.mark.parametrize("kw, param, words", [
    (dict(json={"type": "nonsense"}), "guided_json", "nonsense"),
    (dict(json="{not json"), "guided_json", "not valid JSON"),
    (dict(json=[1, 2]), "guided_json", "JSON object"),
    (dict(regex="a(b"), "guided_regex", "parenthesis|unclosed group"),
    (dict(grammar="root ::= missing"), "guided_grammar", "missing"),
    (dict(choice=[]), "guided_choice", "non-empty"),
    (dict(regex="a", choice=["b"]), "structured_outputs", "exactly one"),
    (dict(regex="a", backend="outlines"), "guided_decoding_backend", "xgrammar"),
])
def test_bad_constraints_are_refused_before_queueing(gllm, kw, param, words):
    engine = gllm.llm_engine
    with pytest.raises(InvalidRequestError, match=words) as info:
        engine.add_request("bad", "x", SamplingParams(
            structured_outputs=StructuredOutputsParams(**kw)))
    assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_compiles_are_cached_by_constraint(gllm):
    compiler = gllm.llm_engine.grammars
    a = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"k": {"type": "integer"}}, '
                                     '"type": "object"}')
    first = compiler.compile(a)
    hits = compiler.hits
    assert compiler.compile(b) is first  # the same schema, spelled differently
    assert compiler.hits == hits + 1


def test_rollback_gives_back_the_earlier_mask(gllm):
    compiler: GrammarCompiler = gllm.llm_engine.grammars
    compiled = compiler.compile(StructuredOutputsParams(regex=r"[ab]{2}c[de]{3}"))
    tok = gllm.get_tokenizer()
    ids = tok.encode("abcde", add_special_tokens=False)
    state = compiler.matcher(compiled)
    state.sync(ids[:1])
    before = compiler.token_bitmask([state])[1].clone()
    state.sync(ids)  # forward ...
    state.sync(ids[:1])  # ... and back, as a preemption that dropped tokens would
    assert torch.equal(compiler.token_bitmask([state])[1], before)
    with pytest.raises(ValueError, match="not allowed"):
        state.sync(ids[:1] + tok.encode("z", add_special_tokens=False))


def test_bitmask_touches_only_its_rows():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros((3, 3), dtype=torch.int32)
    bitmask[1, 0] = 0b101  # row 1 may say tokens 0 and 2 only; rows 0 and 2 hold garbage
    out = apply_token_bitmask(logits, [1], bitmask)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert torch.isfinite(out[1]).tolist() == [i in (0, 2) for i in range(70)]
    assert torch.isfinite(logits).all()  # the input is never modified


def test_choice_grammar_escapes():
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_a_missing_backend_library_is_a_400_naming_the_package():
    assert import_library("json", "decoder", needed_by="x needs") is json
    for package, sub in (("kvserve_no_such_library", ()), ("json", ("no_such_module",))):
        with pytest.raises(InvalidRequestError) as info:
            import_library(package, *sub, needed_by="structured outputs need")
        assert str(info.value) == (f"structured outputs need the {package} package "
                                   f"(pip install {package})")
        assert info.value.param == "structured_outputs"



def test_a_finished_grammar_ends_the_output_despite_min_tokens(gllm):
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = gllm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_auto_falls_back_to_guidance_for_what_xgrammar_refuses(llm):
    """A whitespace_pattern only guidance has; "auto" (the default) serves it with guidance,
    and everything else with xgrammar."""
    compiler = llm.llm_engine.grammars
    assert compiler.backend == "auto"
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+")).backend.name == "xgrammar"
    spaced = StructuredOutputsParams(json=SCHEMAS[3], whitespace_pattern=r"[ ]{0,2}")
    assert compiler.compile(spaced).backend.name == "guidance"
    out = llm.generate("x", SamplingParams(temperature=1.0, seed=2, max_tokens=80,
                                           structured_outputs=spaced), use_tqdm=False)[0]
    check_valid(out.outputs[0].text, SCHEMAS[3])
    # asked of xgrammar by name, it is a 400 naming the field
    with pytest.raises(InvalidRequestError, match="whitespace_pattern") as info:
        llm.llm_engine.add_request("ws", "x", SamplingParams(structured_outputs=(
            StructuredOutputsParams(json=SCHEMAS[3], whitespace_pattern=" ",
                                    backend="xgrammar"))))
    assert info.value.param == "guided_whitespace_pattern"


def test_auto_serves_a_lark_grammar_with_guidance(llm):
    """vLLM's examples write grammars in Lark (`?rule:` inlined rules) as well as EBNF; xgrammar
    reads only EBNF, so "auto" gives Lark to guidance, which takes it as is."""
    lark = ('?start: "SELECT " names " FROM " name\n?names: name ("," name)*\n'
            '?name: /[a-z_]+/\n')
    compiled = llm.llm_engine.grammars.compile(StructuredOutputsParams(grammar=lark))
    assert compiled.backend.name == "guidance"
    out = llm.generate("x", SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                                           structured_outputs=StructuredOutputsParams(
                                               grammar=lark)), use_tqdm=False)[0].outputs[0]
    # a random model may not finish in 60 tokens: the text is then a prefix of the language
    done = r"SELECT [a-z_]+(,[a-z_]+)* FROM [a-z_]+"
    prefix = r"SELECT [a-z_]*(,[a-z_]*)*( (F(R(O(M( [a-z_]*)?)?)?)?)?)?"
    assert re.fullmatch(done if out.finish_reason == "stop" else prefix, out.text), out.text


def test_unknown_backend_is_a_config_error(tiny_model_dir):
    from kvserve.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="structured-outputs-config.backend"):
        make_llm(tiny_model_dir, structured_outputs_config={"backend": "outlines"})
    with pytest.raises(ConfigError, match="disagree"):
        make_llm(tiny_model_dir, structured_outputs_config={"backend": "guidance"},
                 guided_decoding_backend="xgrammar")


def test_structural_tag_constrains_only_the_tagged_section(gllm):
    """vLLM's structural tag (structures + triggers), on both backends: free text, then a
    section opened by its begin whose body must match the schema."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"]}
    tag = json.dumps({"triggers": ["<fn="], "structures": [
        {"begin": "<fn=weather>", "schema": schema, "end": "</fn>"}]})
    compiler: GrammarCompiler = gllm.llm_engine.grammars
    compiled = compiler.compile(StructuredOutputsParams(structural_tag=tag))
    tok = gllm.get_tokenizer()
    good = tok.encode('Hi. <fn=weather>{"city": "Rome"}</fn> ok', add_special_tokens=False)
    compiler.matcher(compiled).sync(good)
    bad = tok.encode('Hi. <fn=weather>{"city": "Oslo"', add_special_tokens=False)
    with pytest.raises(ValueError, match="not allowed"):
        compiler.matcher(compiled).sync(bad)
    with pytest.raises(InvalidRequestError, match="structural tag"):
        StructuredOutputsParams(structural_tag='{"triggers": []}')

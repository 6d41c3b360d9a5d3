"""The guidance structured-output backend (PyPI `llguidance`): constraints become llguidance
grammars (JSON schema, regex, Lark; the EBNF of `grammar` is converted from the GBNF notation
xgrammar reads), validated against the tokenizer when compiled; each sequence gets an LLMatcher
and the step's bitmask rows are filled in parallel by llguidance's executor."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from kvserve.engine.structured_output.backend import GrammarBackend, constraint_error, \
    import_library
from kvserve.engine.structured_output.params import StructuredOutputsParams


def llg() -> Any:
    return import_library("llguidance", "hf", "torch", needed_by="the guidance backend needs")


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int) -> None:
        self._stop = frozenset(stop_token_ids)
        self._tokenizer = llg().hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                  eos_token=list(stop_token_ids) or None)
        self._executor = llg().LLExecutor(max_threads)

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar text, checked against the tokenizer (the matcher is built per sequence
        from it; building one costs well under a millisecond for these grammars)."""
        matcher = llg().LLMatcher
        try:
            grammar = self._grammar(params, matcher)
        except Exception as exc:  # noqa: BLE001 - the converters raise plain Exception
            raise constraint_error(params, str(exc)) from None
        error = matcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise constraint_error(params, " ".join(error.split())[:300])
        return grammar

    def _grammar(self, params: StructuredOutputsParams, matcher: Any) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = _strict(params.schema()) if kind == "json" else {"type": "object"}
            options: dict[str, Any] = {"whitespace_flexible": not params.compact_whitespace}
            if params.compact_whitespace:  # the separators xgrammar's compact JSON uses
                options.update(item_separator=", ", key_separator=": ")
            if params.whitespace_pattern is not None:
                options = {"whitespace_flexible": True,
                           "whitespace_pattern": params.whitespace_pattern}
            return matcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return matcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in params.choice or []))
        if kind == "structural_tag":
            return _structural_tag(params.structural_tag_spec())
        from llguidance.gbnf_to_lark import gbnf_to_lark

        grammar = params.grammar or ""
        if "::=" not in grammar:  # Lark (`?rule:` included), as vLLM tells them apart
            return matcher.grammar_from_lark(grammar)
        return matcher.grammar_from_lark(gbnf_to_lark(grammar))

    def matcher(self, compiled: str) -> GuidanceMatcher:
        return GuidanceMatcher(llg().LLMatcher(self._tokenizer, compiled, log_level=0),
                               self._stop)

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor,
                     indices: list[int]) -> None:
        pairs = [(m.matcher, i) for m, i in zip(matchers, indices)]
        llg().torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)

    def accept_prefix(self, matcher: GuidanceMatcher, tokens: list[int]) -> int:
        """An LLMatcher that consumes a refused token is broken for good (no rollback): the
        run is measured first (`validate_tokens`, no state change), then consumed. EOS right
        after the run is taken when the grammar may end there (`validate_tokens` does not count
        an EOS it could take once the grammar has stopped)."""
        taken = 0
        for tok in tokens[: matcher.matcher.validate_tokens(tokens)]:
            if not matcher.accept_token(tok):
                return taken
            taken += 1
            if matcher.is_terminated():
                return taken
        if taken < len(tokens) and tokens[taken] in self._stop \
                and matcher.matcher.is_accepting() and matcher.accept_token(tokens[taken]):
            taken += 1
        return taken


class GuidanceMatcher:
    """An LLMatcher behind xgrammar's matcher interface. llguidance stops as soon as nothing but
    EOS may follow; xgrammar (and the engine) count a grammar as finished once EOS is taken, so
    that is tracked here: EOS is always the last token, and any rollback undoes it."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self._stop = stop_token_ids
        self._ended = False
        # EOS taken once llguidance had stopped is not in its token history: a rollback over
        # it is one token shorter there (else it would undo the token before EOS too)
        self._eos_unrecorded = False

    def accept_token(self, token: int) -> bool:
        stopped = self.matcher.is_stopped()
        if not self.matcher.consume_token(token):
            return False
        self._ended = token in self._stop
        self._eos_unrecorded = self._ended and stopped
        return True

    def rollback(self, num_tokens: int) -> None:
        recorded = num_tokens - (self._ended and self._eos_unrecorded and num_tokens > 0)
        if recorded and not self.matcher.rollback(recorded):
            raise ValueError(f"llguidance could not roll back {num_tokens} tokens: "
                             f"{self.matcher.get_error()}")
        self._ended = self._eos_unrecorded = False

    def is_terminated(self) -> bool:
        return self._ended


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples")  # data, not schemas


def _strict(schema: Any) -> Any:
    """xgrammar's strict mode for llguidance: objects without `additionalProperties` take
    none (the schema still validates them either way; unbounded extra keys only let a model
    wander)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _VALUES else _strict(value)
    if (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _structural_tag(spec: dict[str, Any]) -> str:
    """vLLM's structural tag as llguidance's StructTag grammar (each begin under its trigger)."""
    if "structures" not in spec:
        raise ValueError("xgrammar's {\"format\": ...} structural tag needs the xgrammar backend")
    tags = []
    for s in spec["structures"]:
        trigger = next((t for t in spec["triggers"] if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the begin {s['begin']!r}")
        tags.append(llg().StructTag(trigger=trigger, begin=s["begin"], end=s["end"],
                                    grammar=s.get("schema", {"type": "object"})))
    return llg().StructTag.to_grammar(tags)

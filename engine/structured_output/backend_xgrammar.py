"""The xgrammar structured-output backend (PyPI `xgrammar`): constraints compiled to grammars
against the tokenizer's vocabulary table, one GrammarMatcher per sequence, and xgrammar's batch
filler for the step's bitmask rows."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.backend import GrammarBackend, choice_grammar, \
    constraint_error, import_library
from kvserve.engine.structured_output.params import StructuredOutputsParams

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# xgrammar 0.2 writes the characters of a length-bounded string as "anything but a quote, a
# backslash or a line break", which lets raw control characters through: invalid JSON. Its
# unbounded strings use the right class; the bounded ones are given the same.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


def xgr() -> Any:
    return import_library("xgrammar", needed_by="structured outputs need")


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int) -> None:
        # Building the tokenizer's vocabulary table costs a moment: on the first constrained
        # request, not at engine start.
        info = xgr().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        # The GrammarCompiler's own cache holds the results; xgrammar's would keep a second copy.
        self._compiler = xgr().GrammarCompiler(info, max_threads=max_threads,
                                               cache_enabled=False)
        self._filler = xgr().BatchGrammarMatcher(max_threads=max_threads)

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise InvalidRequestError(
                "whitespace_pattern is not supported by the xgrammar backend; use "
                "disable_any_whitespace, or the guidance backend",
                param="guided_whitespace_pattern")
        try:
            if kind in ("json", "json_object"):
                # json_object is OpenAI's: an object, any keys (hence not strict).
                schema = json.dumps(params.schema()) if kind == "json" else '{"type": "object"}'
                grammar = xgr().Grammar.from_json_schema(
                    schema, any_whitespace=not params.compact_whitespace,
                    strict_mode=kind == "json")
                return self._compiler.compile_grammar(
                    str(grammar).replace(_LOOSE_CHAR, _JSON_CHAR))
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(params.choice or []))
            if kind == "structural_tag":
                return self._structural_tag(params.structural_tag_spec())
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise constraint_error(params, _clean(exc)) from None

    def _structural_tag(self, spec: dict[str, Any]) -> Any:
        if "structures" not in spec:  # xgrammar's own form
            return self._compiler.compile_structural_tag(spec)
        tags = [xgr().StructuralTagItem(begin=s["begin"], end=s["end"],
                                        schema=json.dumps(s.get("schema", {"type": "object"})))
                for s in spec["structures"]]
        return self._compiler.compile_structural_tag(tags, spec["triggers"])

    def matcher(self, compiled: Any) -> Any:
        # accept_token / rollback / is_terminated: the GrammarState interface, natively;
        # xgrammar keeps the whole history, so a rollback may go back any number of tokens.
        return xgr().GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor,
                     indices: list[int]) -> None:
        self._filler.batch_fill_next_token_bitmask(matchers, bitmask, indices=indices)


def _clean(exc: BaseException) -> str:
    """xgrammar's C++ message without its log prefix (time, source file and line)."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text).splitlines()[0] if text else type(exc).__name__

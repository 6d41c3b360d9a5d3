"""StructuredOutputsParams: what a request's output must match (a JSON schema, any JSON object, a
regex, one of several strings, or an EBNF grammar), with vLLM's names: `GuidedDecodingParams` is
the older spelling of the same class. Checked here without compiling;
grammar.py compiles."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.errors import InvalidRequestError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | bool | None = None  # a JSON schema (text or parsed)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF, in xgrammar's (GBNF-like) notation
    json_object: bool | None = None  # any JSON object, as OpenAI's response_format json_object
    # vLLM's structural tag (JSON text): free text in which each trigger starts a tagged section
    # whose body must match a schema: {"structures": [{"begin", "schema", "end"}], "triggers":
    # [...]}, or xgrammar's own {"format": {...}} form (the xgrammar backend only)
    structural_tag: str | None = None
    # None = compact JSON (no whitespace between tokens): a small model allowed "any whitespace"
    # can spend its whole budget on newlines. False allows any whitespace, as vLLM's default.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # JSON whitespace regex (the guidance backend only)
    backend: str | None = None  # None / "auto" = the engine's; "xgrammar" or "guidance"
    # The request field an error should name (the server sets it: "response_format", ...).
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.verify()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def verify(self) -> None:
        """InvalidRequestError naming what is wrong; nothing here needs the tokenizer."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, regex, choice, grammar or "
                f"json_object; got {given or 'none'}", param="structured_outputs")
        if self.backend not in (None, "auto", "xgrammar", "guidance"):
            raise InvalidRequestError(
                f"structured output backend {self.backend!r} is not available; use 'auto', "
                "'xgrammar' or 'guidance'", param="guided_decoding_backend")
        if self.whitespace_pattern is not None and not (
                isinstance(self.whitespace_pattern, str) and self.whitespace_pattern):
            raise InvalidRequestError("whitespace_pattern must be a non-empty regex",
                                      param="guided_whitespace_pattern")
        self._verify_value()

    def _verify_value(self) -> None:
        if self.json is not None:
            self.schema()
        elif self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequestError("regex must be a non-empty string", param="guided_regex")
        elif self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                      param="guided_choice")
        elif self.grammar is not None and (not isinstance(self.grammar, str)
                                           or not self.grammar.strip()):
            raise InvalidRequestError("grammar must be a non-empty EBNF string",
                                      param="guided_grammar")
        elif self.structural_tag is not None:
            self.structural_tag_spec()
        elif self.json_object not in (None, True, False):
            raise InvalidRequestError("json_object must be true or false", param="json_object")

    def schema(self) -> dict | bool:
        """The JSON schema, parsed; InvalidRequestError if it is not a JSON object or boolean."""
        value = _parsed(self.json, "JSON schema", "guided_json")
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be a JSON object (or true/false), got "
                                      f"{type(value).__name__}", param="guided_json")
        return value

    def structural_tag_spec(self) -> dict[str, Any]:
        """The structural tag, parsed; InvalidRequestError naming what is missing."""
        value = _parsed(self.structural_tag, "structural tag", "structural_tag")
        if not isinstance(value, dict) or not ("format" in value or (
                isinstance(value.get("structures"), list) and value["structures"]
                and isinstance(value.get("triggers"), list) and value["triggers"]
                and all(isinstance(s, dict) and {"begin", "end"} <= set(s)
                        for s in value["structures"]))):
            raise InvalidRequestError(
                'a structural tag needs {"structures": [{"begin": ..., "schema": {...}, "end": '
                '...}], "triggers": [...]} (or xgrammar\'s {"format": {...}})',
                param="structural_tag")
        return value

    def cache_key(self) -> tuple[str, str, bool, bool, str | None]:
        """Equal for constraints that compile to the same grammar (schemas compared as parsed)."""
        kind = self.kind
        if kind == "json":
            text = json.dumps(self.schema(), sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(self.choice)
        elif kind == "json_object":
            text = ""
        elif kind == "structural_tag":
            text = json.dumps(self.structural_tag_spec(), sort_keys=True)
        else:
            text = getattr(self, kind)
        return (kind, text, self.compact_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)

    @property
    def compact_whitespace(self) -> bool:
        return self.disable_any_whitespace is not False


GuidedDecodingParams = StructuredOutputsParams


def _parsed(value: Any, what: str, param: str) -> Any:
    """`value` as given, or parsed when it is a JSON string; InvalidRequestError naming `what`."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise InvalidRequestError(f"the {what} is not valid JSON: {exc}", param=param) from None

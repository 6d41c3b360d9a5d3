"""The interface every structured-output backend implements, and the helpers they share (lazy
library import, the error for a constraint that cannot compile, the grammar of a choice)."""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from typing import Any

import torch
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.params import StructuredOutputsParams

_PARAM = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
          "grammar": "guided_grammar", "json_object": "response_format",
          "structural_tag": "response_format"}


class GrammarBackend(ABC):
    """One structured-output library. A matcher has `accept_token(t) -> bool`,
    `rollback(n)` and `is_terminated()` (True once it took EOS), as xgrammar's."""

    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint; InvalidRequestError (constraint_error) if it cannot be."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor,
                     indices: list[int]) -> None:
        """Fill row indices[i] of the int32 bitmask from matchers[i] (distinct matchers)."""

    def accept_prefix(self, matcher: Any, tokens: list[int]) -> int:
        """Accept the longest leading run of `tokens` the grammar allows (ending at a token
        that terminates it); how many. A refused token leaves the matcher as it was (xgrammar
        refuses without moving; a backend whose matcher breaks on a refusal overrides this)."""
        taken = 0
        for tok in tokens:
            if not matcher.accept_token(tok):
                break
            taken += 1
            if matcher.is_terminated():
                break
        return taken


def import_library(package: str, *submodules: str, needed_by: str) -> Any:
    """`package` (and its `submodules`), imported on first use: engines that never see a
    constraint never load it. Missing, it is a 400 naming the pip package; `needed_by` starts
    that message ("structured outputs need")."""
    try:
        module = importlib.import_module(package)
        for sub in submodules:
            importlib.import_module(f"{package}.{sub}")
    except ImportError as exc:  # both are dependencies of kvserve: a broken install
        raise InvalidRequestError(f"{needed_by} the {package} package (pip install {package})",
                                  param="structured_outputs") from exc
    return module


def constraint_error(params: StructuredOutputsParams, why: str) -> InvalidRequestError:
    kind = params.kind
    what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
    return InvalidRequestError(f"the {what} cannot be used: {why}",
                               param=params.source or _PARAM[kind])


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

"""A request's structured-output fields -> StructuredOutputsParams: OpenAI's `response_format`
(json_object, json_schema, and vLLM's structural_tag), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and its newer `structured_outputs` object. At most one of them per request."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputsParams)} - {"source"}


def constraint_of(req: Any) -> StructuredOutputsParams | None:
    """The request's constraint, or None; InvalidRequestError naming the field at fault."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = _response_format(getattr(req, "response_format", None))
    if fmt is not None:
        found.append(("response_format", fmt))
    names = [name for name in _GUIDED if getattr(req, name, None) is not None]
    if names:
        guided = {_GUIDED[name]: getattr(req, name) for name in names}
        found.append((names[0], _build({**guided, "source": names[0]}, req, names[0])))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(so) - _FIELDS)
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown fields {unknown}; known: "
                                      f"{sorted(_FIELDS)}", "structured_outputs")
        found.append(("structured_outputs",
                      _build({**so, "source": "structured_outputs"}, None, "structured_outputs")))
    if len(found) > 1:
        raise InvalidRequestError(
            f"give one structured-output constraint, not {[name for name, _ in found]}",
            found[1][0])
    return found[0][1] if found else None


def _build(fields: dict[str, Any], req: Any, param: str) -> StructuredOutputsParams:
    if req is not None:
        backend = getattr(req, "guided_decoding_backend", None)
        if backend is not None:
            fields = {**fields, "backend": backend}
        pattern = getattr(req, "guided_whitespace_pattern", None)
        if pattern is not None:
            fields = {**fields, "whitespace_pattern": pattern}
    try:
        return StructuredOutputsParams(**fields)
    except TypeError as exc:  # a value of the wrong shape
        raise InvalidRequestError(f"{param}: {exc}", param) from None


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format json_schema needs "
                                      '{"json_schema": {"name": ..., "schema": {...}}}',
                                      "response_format")
        try:
            return StructuredOutputsParams(json=spec["schema"], source="response_format")
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), "response_format") from None
    if kind == "structural_tag":  # vLLM's: the whole object is the tag
        spec = {k: v for k, v in fmt.items() if k != "type"}
        try:
            return StructuredOutputsParams(structural_tag=json.dumps(spec),
                                           source="response_format")
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), "response_format") from None
    raise InvalidRequestError("response_format type must be 'text', 'json_object', "
                              f"'json_schema' or 'structural_tag', got {kind!r}",
                              "response_format")

"""A request body checked at the edge: JSON parsed with bounded nesting, then a request model
validated against the caps. Server and router both call it, so a body the router lets through
is one the replicas accept."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import ValidationError

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.limits import RequestLimits
from kvserve.service.openai_errors import APIError, validation_error
from kvserve.service.request_models import OpenAIModel

M = TypeVar("M", bound=OpenAIModel)
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object; InvalidRequestError for invalid JSON or UTF-8, an integer past
    Python's parsing limit, nesting deeper than `max_depth`, an unpaired surrogate, a non-object.

    The C parser raises RecursionError on very deep input (caught here); anything shallower than
    that is measured by an iterative walk, so no later recursive code sees a deep tree."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise InvalidRequestError("the request body holds an unpaired UTF-16 surrogate "
                                          "(\\ud800-\\udfff); send valid Unicode text")
            continue
        if depth > max_depth:
            raise _too_deep(max_depth)
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)) or (
            isinstance(c, str) and not c.isascii()))
    return data


def _too_deep(max_depth: int) -> InvalidRequestError:
    return InvalidRequestError(f"the request body is nested deeper than {max_depth} levels of "
                               "arrays and objects (--max-json-depth)")


def read_json_body(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The body as a JSON object; APIError 400 (`invalid_json`) otherwise."""
    try:
        return parse_json_object(raw, limits.max_json_depth)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), code="invalid_json") from exc


def validate_request(data: dict[str, Any], model: type[M], limits: RequestLimits) -> M:
    """`data` as `model`, checked against `limits`; APIError 400 naming the first bad field."""
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    try:
        parsed.check(limits)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
    return parsed

"""The server's OpenAPI document with the request bodies it reads.

Handlers read their bodies themselves (bounded JSON nesting, then the request model against the
caps: service/request_validation.py), so FastAPI cannot see what they take; this adds each
route's request model as its `requestBody`, so clients and fuzzers see the real contract."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """`app.openapi()` documents `bodies` (POST path -> request model) as JSON request bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF.format(
                        model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

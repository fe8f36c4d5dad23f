"""Request body schemas for the webhook routes in the OpenAPI document. The routes read
raw bytes (the body cap, signatures and verbatim storage need them), so FastAPI cannot
infer their bodies; the document still describes them, for clients and for schemathesis."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with every ``$defs`` reference inlined."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(copy.deepcopy(defs[ref.split("/")[-1]]))
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    inlined: dict[str, Any] = resolve(schema)
    return inlined


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(model)}}}
    }

"""Instances of a JSON Schema, made from the schema alone: the smallest one it allows, and
one for each optional property and enum value, so a test can try every payload shape a
platform's document allows (not only the shapes the project expects). Pure.

``minimal`` takes only what is required (so a recursive type, a Message that quotes a
Message, ends); ``variants`` adds each optional property to the smallest instance, one at
a time, and tries each value of an enumerated property, and ``without_each`` drops each
property of a full instance, one at a time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

Schema = Mapping[str, Any]


class Resolver:
    """``$ref`` to ``#/definitions/...`` (the Telegram document as JSON Schema) or to
    ``#/components/schemas/...`` (OpenAPI) against the root schema or document."""

    def __init__(self, root: Schema) -> None:
        self.root = root

    def __call__(self, schema: Schema) -> Schema:
        while "$ref" in schema:
            target: Any = self.root
            for part in schema["$ref"].removeprefix("#/").split("/"):
                target = target[part]
            schema = target
        return schema


def minimal(schema: Schema, resolve: Resolver) -> Any:
    schema = resolve(schema)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return next(v for v in schema["enum"] if v is not None)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return minimal(schema[key][0], resolve)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        return {name: minimal(props[name], resolve) for name in schema.get("required", []) if name in props}
    if kind == "array":
        return [minimal(schema.get("items", {}), resolve)] * schema.get("minItems", 0)
    if kind == "string":
        return "x" * max(1, schema.get("minLength", 1))
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.5))
    if kind == "boolean":
        return True
    return {}


def full(schema: Schema, resolve: Resolver) -> dict[str, Any]:
    """An object with every property its schema names, each at its smallest."""
    schema = resolve(schema)
    return {name: minimal(prop, resolve) for name, prop in schema.get("properties", {}).items()}


def variants(schema: Schema, resolve: Resolver) -> Iterator[tuple[str, Any]]:
    """(label, instance): the smallest instance, then with each optional property, then
    with each value of each enumerated property."""
    schema = resolve(schema)
    base = minimal(schema, resolve)
    yield "minimal", base
    props: Mapping[str, Any] = schema.get("properties", {})
    for name, prop in props.items():
        if name not in base:
            yield f"+{name}", {**base, name: minimal(prop, resolve)}
        for value in resolve(prop).get("enum", ())[1:]:
            if value is not None:
                yield f"{name}={value}", {**base, name: value}


def without_each(instance: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, instance): ``instance`` without each of its properties, one at a time."""
    for name in instance:
        yield f"-{name}", {k: v for k, v in instance.items() if k != name}

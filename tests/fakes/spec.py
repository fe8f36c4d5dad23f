"""The platforms' own reference documents as validators, so the fakes cannot accept what
the real platforms refuse, nor answer what they never would.

The documents are the project's own copy, in ``tests/fakes/reference`` (its README says
where each comes from and under which terms): Avito's OpenAPI documents for the Messenger
and Authorization APIs, and the Telegram Bot API as data (every method and type, with
field types and whether each is required). A missing directory is an error, never a silent
skip: a fake that validates nothing would pass every test.

Where real traffic and the public clients that talk to the live API every day show more
than Avito's documents (an object-shaped message list, ``/core/v1/accounts/self``, the
token path with a trailing slash), ``avito-observed-openapi.json`` beside them says so,
with the evidence for each; the fakes allow what it adds, and nothing else beyond the
documents.

Everything here is pure: a request or an answer goes in, a list of problems comes out
(empty when the document allows it). ``tests/fakes/platforms.py`` applies it to every
call it receives and every answer it gives.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from jsonschema import Draft7Validator

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
AVITO_DOCUMENTS = ("avito-messenger-openapi.json", "avito-auth-openapi.json")
#: What real traffic and public clients show beyond Avito's documents (see the module's
#: docstring): paths and answers of its own, and ``x-chatq-observed`` amendments.
AVITO_OBSERVED = "avito-observed-openapi.json"
TELEGRAM_DOCUMENT = "telegram-bot-api.json"


class ReferenceMissing(RuntimeError):
    """The reference documents are not where the checkout expects them."""


def reference_dir(path: Path = REFERENCE_DIR) -> Path:
    missing = [n for n in (*AVITO_DOCUMENTS, AVITO_OBSERVED, TELEGRAM_DOCUMENT) if not (path / n).is_file()]
    if missing:
        raise ReferenceMissing(
            f"the platforms' reference documents are missing from {path}: {', '.join(missing)}. "
            "The fakes validate every request against them; they are part of the repository "
            "(tests/fakes/reference): restore them from git."
        )
    return path


def _load(name: str) -> Any:
    return json.loads((reference_dir() / name).read_text(encoding="utf-8"))


#: Validators by schema identity (the schema is kept with it, so an id is never reused).
_VALIDATORS: dict[int, tuple[Mapping[str, Any], Draft7Validator]] = {}


def _problems(schema: Mapping[str, Any], instance: object, where: str) -> list[str]:
    """What ``instance`` breaks in ``schema``, each as "where.path: message"."""
    hit = _VALIDATORS.get(id(schema))
    if hit is None or hit[0] is not schema:
        hit = _VALIDATORS[id(schema)] = (schema, Draft7Validator(schema))
    out = []
    for error in sorted(hit[1].iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path]):
        path = ".".join(str(p) for p in error.absolute_path)
        message, shown = error.message, repr(error.instance)
        if len(shown) > 80:
            size = len(error.instance) if isinstance(error.instance, str | list | dict) else len(shown)
            message = message.replace(shown, f"<{type(error.instance).__name__} of length {size}>")
        out.append(f"{where}{'.' + path if path else ''}: {message}")
    return out


# --------------------------------------------------------------------------------------
# Avito: OpenAPI 3.0


#: Where Avito's own document contradicts itself, the correction the fake applies, each
#: with the reason. Nothing else is changed.
AVITO_ERRATA: dict[str, tuple[dict[str, Any], str]] = {
    "sendMessageRequestBody": (
        {"required": ["message"], "properties.message.required": ["text"]},
        "the document requires 'url' (copied from webhookSubscribeRequestBody); a message "
        "has no url, and its description says only text messages can be sent",
    ),
}


def _apply_errata(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    schemas = doc.get("components", {}).get("schemas", {})
    for name, (changes, _reason) in AVITO_ERRATA.items():
        if name not in schemas:
            continue
        for dotted, value in changes.items():
            target = schemas[name]
            *parents, key = dotted.split(".")
            for p in parents:
                target = target[p]
            target[key] = value
    return doc


def _apply_observed_properties(doc: dict[str, Any], additions: Mapping[str, Any]) -> dict[str, Any]:
    """Properties a schema is seen with beyond its document (``schema-properties``)."""
    schemas = doc.get("components", {}).get("schemas", {})
    for name, addition in additions.items():
        if name in schemas:
            schemas[name].setdefault("properties", {}).update(addition["properties"])
    return doc


def openapi_schema(node: Any, doc: Mapping[str, Any], *, strict: bool, _seen: tuple[str, ...] = ()) -> Any:
    """An OpenAPI 3.0 schema as plain JSON Schema: ``$ref`` resolved inline, ``nullable``
    as a null type, and with ``strict`` no properties beyond those named (our requests
    and the fakes' answers should carry only what the document describes)."""
    if isinstance(node, list):
        return [openapi_schema(n, doc, strict=strict, _seen=_seen) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        ref = node["$ref"]
        if ref in _seen:
            return {}
        target: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        return openapi_schema(target, doc, strict=strict, _seen=(*_seen, ref))
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("example", "x-examples", "description", "nullable") or key.startswith("x-"):
            continue
        if key == "properties":
            out[key] = {k: openapi_schema(v, doc, strict=strict, _seen=_seen) for k, v in value.items()}
        else:
            out[key] = openapi_schema(value, doc, strict=strict, _seen=_seen)
    if strict and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


@dataclass(frozen=True)
class Parameter:
    name: str
    where: str  # path, query, header
    required: bool
    schema: dict[str, Any]


@dataclass(frozen=True)
class Operation:
    """One operation of an OpenAPI document, with everything a request is checked
    against and every answer it documents."""

    method: str
    template: str
    operation_id: str
    parameters: tuple[Parameter, ...]
    #: content type -> schema; empty when the operation takes no body.
    bodies: Mapping[str, dict[str, Any]]
    #: status -> schema of the JSON answer (None: documented without a body).
    responses: Mapping[str, dict[str, Any] | None]
    pattern: re.Pattern[str] = field(compare=False)


@dataclass
class AvitoCheck:
    """The outcome of checking one request: the operation it is (None: the documents
    have no such path), its path parameters, its parsed body, what the documents do not
    allow, and whether it lacks the Authorization header they require."""

    operation: Operation | None
    path_params: dict[str, Any]
    body: Any
    problems: list[str]
    unauthenticated: bool = False
    #: The documented query parameters given, read as their schemas' types.
    query: dict[str, Any] = field(default_factory=dict)
    #: The client id the request's token was issued to (set by the fake, which issued it).
    client_id: str | None = None


def _coerce(value: str, schema: Mapping[str, Any]) -> Any:
    """A path or query value (always text on the wire) as the type its schema names;
    left as text when it is not one, so the schema check reports it."""
    kind = schema.get("type")
    if kind == "integer" and re.fullmatch(r"-?\d+", value):
        return int(value)
    if kind == "number":
        try:
            return float(value)
        except ValueError:
            return value
    if kind == "boolean" and value in ("true", "false"):
        return value == "true"
    return value


class OpenApiSpec:
    """Avito's Messenger and Authorization APIs from their OpenAPI documents, with what
    ``observed`` (``avito-observed-openapi.json``) adds: its own paths, and its
    ``x-chatq-observed`` amendments (path aliases, other shapes of an answer, properties a
    schema is seen with)."""

    def __init__(
        self, documents: Iterable[Mapping[str, Any]], observed: Mapping[str, Any] | None = None
    ) -> None:
        self.operations: list[Operation] = []
        self._error_schema: dict[str, Any] = {}
        amendments: Mapping[str, Any] = (observed or {}).get("x-chatq-observed", {})
        #: A path as sent -> the documented path it is (Avito's token path with a slash).
        self.aliases: dict[str, str] = {k: v["to"] for k, v in amendments.get("path-aliases", {}).items()}
        for raw in [*documents, *([observed] if observed is not None else [])]:
            doc = _apply_observed_properties(
                _apply_errata(dict(raw)), amendments.get("schema-properties", {})
            )
            for raw_path, item in doc["paths"].items():
                # Avito lists several operations on one path by adding invisible marks
                # (U+200E) to the key: they are the same path on the wire.
                template = raw_path.replace("\u200e", "")
                shared = item.get("parameters", [])
                for method, op in item.items():
                    if method == "parameters":
                        continue
                    self.operations.append(self._operation(doc, method, template, shared, op))
            schemas = doc.get("components", {}).get("schemas", {})
            if "validatingError" in schemas:
                # The widest of Avito's error documents ({"error": {code, message, fields}}).
                error = openapi_schema(schemas["validatingError"], doc, strict=True)
                self._error_schema = {**error, "required": ["error"]}
        # A concrete path wins over a template that also matches it (OpenAPI's rule).
        self.operations.sort(key=lambda o: (o.template.count("{"), o.template))
        for op_id, answers in amendments.get("answer-alternatives", {}).items():
            for op in self.operations:
                if op.operation_id != op_id:
                    continue
                for status, alt in answers.items():
                    documented = op.responses[status]
                    assert documented is not None, f"{op_id} {status} documents no body to wrap"
                    wrapped = {
                        "type": "object",
                        "properties": {alt["wrap"]: documented, **alt.get("extra", {})},
                        "required": [alt["wrap"]],
                        "additionalProperties": False,
                    }
                    op.responses[status] = {"anyOf": [documented, wrapped]}  # type: ignore[index]  # a dict

    @staticmethod
    def _operation(
        doc: Mapping[str, Any], method: str, template: str, shared: list[Any], op: Mapping[str, Any]
    ) -> Operation:
        params = []
        for p in [*shared, *op.get("parameters", [])]:
            p = openapi_schema(p, doc, strict=False)
            params.append(Parameter(p["name"], p["in"], bool(p.get("required")), p.get("schema", {})))
        bodies = {
            ctype: openapi_schema(media.get("schema", {}), doc, strict=True)
            for ctype, media in op.get("requestBody", {}).get("content", {}).items()
        }
        responses: dict[str, dict[str, Any] | None] = {}
        for status, answer in op.get("responses", {}).items():
            media = answer.get("content", {}).get("application/json")
            responses[status] = openapi_schema(media["schema"], doc, strict=True) if media else None
        regex = re.sub(r"\\\{[^/]+?\\\}", "([^/]+)", re.escape(template))
        return Operation(
            method.upper(),
            template,
            op.get("operationId", f"{method} {template}"),
            tuple(params),
            bodies,
            responses,
            re.compile(f"^{regex}$"),
        )

    def match(self, method: str, path: str) -> tuple[list[Operation], dict[str, str]]:
        """The operations ``method path`` may be, and its path parameters as text."""
        path = self.aliases.get(path, path)
        found: list[Operation] = []
        values: dict[str, str] = {}
        for op in self.operations:
            m = op.pattern.match(path)
            if m is None or op.method != method.upper():
                continue
            if found and op.template != found[0].template:
                break
            names = re.findall(r"\{([^/]+?)\}", op.template)
            # Each parameter is one segment of the path as sent (%2F stays in it), decoded.
            values = {n: unquote(v) for n, v in zip(names, m.groups(), strict=True)}
            found.append(op)
        return found, values

    def check_request(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        body: bytes,
    ) -> AvitoCheck:
        operations, raw_params = self.match(method, path)
        if not operations:
            known = sorted({o.template for o in self.operations if o.pattern.match(path)})
            why = f"only {', '.join(known)} with other methods" if known else "no such path"
            return AvitoCheck(None, {}, None, [f"{method} {path}: not in Avito's documents ({why})"])
        attempts = [self._check(op, raw_params, query, headers, body) for op in operations]
        # Several candidates (the token endpoint's grant types): the request is allowed
        # when one of them allows it; otherwise the closest one says why not.
        return min(attempts, key=lambda a: len(a.problems))

    def _check(
        self,
        op: Operation,
        raw_params: Mapping[str, str],
        query: str,
        headers: Mapping[str, str],
        body: bytes,
    ) -> AvitoCheck:
        problems: list[str] = []
        unauthenticated = False
        where = f"{op.method} {op.template}"
        path_params: dict[str, Any] = {}
        query_params: dict[str, Any] = {}
        lowered = {k.lower(): v for k, v in headers.items()}
        query_values = parse_qs(query, keep_blank_values=True)
        known_query = {p.name for p in op.parameters if p.where == "query"}
        for unknown in sorted(set(query_values) - known_query):
            problems.append(f"{where}: query parameter {unknown!r} is not in the document")
        for p in op.parameters:
            if p.where == "path":
                value: Any = _coerce(raw_params[p.name], p.schema)
                path_params[p.name] = value
            elif p.where == "query":
                if p.name not in query_values:
                    if p.required:
                        problems.append(f"{where}: required query parameter {p.name!r} is missing")
                    continue
                texts = query_values[p.name]
                if p.schema.get("type") == "array":
                    items = p.schema.get("items", {})
                    value = [_coerce(v, items) for t in texts for v in t.split(",")]
                else:
                    if len(texts) > 1:
                        problems.append(f"{where}: query parameter {p.name!r} given {len(texts)} times")
                    value = _coerce(texts[-1], p.schema)
                query_params[p.name] = value
            elif p.where == "header":
                if p.name.lower() not in lowered:
                    if p.required:
                        problems.append(f"{where}: required header {p.name!r} is missing")
                        unauthenticated = unauthenticated or p.name.lower() == "authorization"
                    continue
                value = lowered[p.name.lower()]
            else:
                continue
            problems += _problems(p.schema, value, f"{where}: {p.where} parameter {p.name}")
        parsed: Any = None
        content_type = lowered.get("content-type", "").split(";")[0].strip().lower()
        if not op.bodies:
            if body.strip():
                problems.append(f"{where}: takes no request body, got {len(body)} bytes")
        elif not body:
            problems.append(f"{where}: the request body is missing ({', '.join(op.bodies)})")
        elif content_type not in op.bodies:
            problems.append(f"{where}: content type {content_type or 'none'!r} is not {', '.join(op.bodies)}")
        else:
            parsed, parse_problem = _parse_body(content_type, body)
            if parse_problem:
                problems.append(f"{where}: {parse_problem}")
            else:
                problems += _problems(op.bodies[content_type], parsed, f"{where}: body")
        return AvitoCheck(op, path_params, parsed, problems, unauthenticated, query_params)

    def check_response(self, op: Operation, status: int, body: Any) -> list[str]:
        where = f"answer {status} to {op.method} {op.template}"
        if str(status) in op.responses:
            schema = op.responses[str(status)]
            return [] if schema is None else _problems(schema, body, where)
        if status < 400:
            return [f"{where}: the document gives no such answer ({', '.join(op.responses)})"]
        return _problems(self._error_schema, body, where)

    def check_error(self, body: Any) -> list[str]:
        return _problems(self._error_schema, body, "Avito error")


def _parse_body(content_type: str, body: bytes) -> tuple[Any, str | None]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None, "the body is not UTF-8"
    if content_type == "application/json":
        try:
            return json.loads(text), None
        except ValueError:
            return None, "the body is not JSON"
    if content_type == "application/x-www-form-urlencoded":
        form = parse_qs(text, keep_blank_values=True)
        return {k: v[-1] for k, v in form.items()}, None
    return None, f"the fake cannot read {content_type} bodies"


# --------------------------------------------------------------------------------------
# Telegram: the Bot API as data

_PRIMITIVES: dict[str, dict[str, Any]] = {
    "Integer": {"type": "integer"},
    "Float": {"type": "number"},
    "String": {"type": "string"},
    "Boolean": {"type": "boolean"},
    "True": {"const": True},
    # Uploaded with multipart/form-data, or a string (file_id, URL, attach://).
    "InputFile": {},
}
_SUCCESS_KEYS = ("ok", "result", "description")
_LENGTH = re.compile(r"\b(\d+)-(\d+) characters\b")


def _update_kinds(doc: Mapping[str, Any]) -> list[str]:
    return [f["name"] for f in doc["types"]["Update"]["fields"] if f["name"] != "update_id"]


def _described(doc: Mapping[str, Any]) -> dict[tuple[str, str], tuple[dict[str, Any], str]]:
    """Limits the Bot API states in a field's description rather than its type, each
    with the sentence it comes from. "N-M characters" on a String field is read from
    every description; these are the others the project's calls depend on."""
    return {
        ("setWebhook", "secret_token"): (
            {"pattern": "^[A-Za-z0-9_-]*$"},
            "Only characters A-Z, a-z, 0-9, _ and - are allowed.",
        ),
        ("setWebhook", "max_connections"): ({"minimum": 1, "maximum": 100}, "1-100. Defaults to 40."),
        ("setWebhook", "allowed_updates"): (
            {"items": {"enum": _update_kinds(doc)}},
            "See Update for a complete list of available update types.",
        ),
    }


# Parameters the document no longer lists that the Bot API still honours and real clients
# still send: Bot API 7.0 replaced disable_web_page_preview with link_preview_options, and
# Alertmanager's telegram_configs (0.24 to 0.27, which chatqueue's compose stack runs)
# sends it with every message.
_STILL_ACCEPTED: dict[str, list[dict[str, Any]]] = {
    method: [{"name": "disable_web_page_preview", "types": ["Boolean"], "required": False}]
    for method in ("sendMessage", "editMessageText")
}


class TelegramSpec:
    """Every method and type of the Bot API (the version in the document) as JSON Schema."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.version = str(doc.get("version", ""))
        self._doc = doc
        self._defs = {name: self._type(t) for name, t in doc["types"].items()}
        described = _described(doc)
        self.methods: dict[str, str] = {name.lower(): name for name in doc["methods"]}
        self._params: dict[str, dict[str, Any]] = {}
        self._fields: dict[str, dict[str, list[str]]] = {}
        for name, method in doc["methods"].items():
            fields = method.get("fields", []) + _STILL_ACCEPTED.get(name, [])
            props = {}
            for f in fields:
                schema = self._field(f)
                extra = described.get((name, f["name"]))
                if extra:
                    schema = _merge(schema, extra[0])
                props[f["name"]] = schema
            self._params[name] = self._with_defs(
                {
                    "type": "object",
                    "properties": props,
                    "required": [f["name"] for f in fields if f["required"]],
                    "additionalProperties": False,
                }
            )
            self._fields[name] = {f["name"]: f["types"] for f in fields}
        self._returns = {
            name: self._with_defs(self._union(m.get("returns", []))) for name, m in doc["methods"].items()
        }
        envelope = {
            "type": "object",
            "properties": {
                "ok": {"const": False},
                "error_code": {"type": "integer"},
                "description": {"type": "string"},
                "parameters": {"$ref": "#/definitions/ResponseParameters"},
            },
            "required": ["ok", "error_code", "description"],
            "additionalProperties": False,
        }
        self._error = self._with_defs(envelope)
        self._types: dict[str, dict[str, Any]] = {}

    def _with_defs(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {**schema, "definitions": self._defs}

    def _type(self, t: Mapping[str, Any]) -> dict[str, Any]:
        if t["name"] in _PRIMITIVES:
            return _PRIMITIVES[t["name"]]
        if "subtypes" in t:
            return self._union(t["subtypes"])
        fields = t.get("fields")
        if not fields:
            return {"type": "object"}
        return {
            "type": "object",
            "properties": {f["name"]: self._field(f) for f in fields},
            "required": [f["name"] for f in fields if f["required"]],
            "additionalProperties": False,
        }

    def _field(self, f: Mapping[str, Any]) -> dict[str, Any]:
        schema = self._union(f["types"])
        m = _LENGTH.search(f.get("description", ""))
        if m and f["types"] == ["String"]:
            schema = {**schema, "minLength": int(m.group(1)), "maxLength": int(m.group(2))}
        return schema

    def _union(self, names: Iterable[str]) -> dict[str, Any]:
        options = [self._named(n) for n in names]
        if not options:
            return {}
        return options[0] if len(options) == 1 else {"anyOf": options}

    def _named(self, name: str) -> dict[str, Any]:
        if name.startswith("Array of "):
            return {"type": "array", "items": self._named(name.removeprefix("Array of "))}
        if name in _PRIMITIVES:
            return _PRIMITIVES[name]
        if name in self._doc["types"]:
            return {"$ref": f"#/definitions/{name}"}
        raise ValueError(f"the Bot API document names an unknown type {name!r}")

    def method(self, name: str) -> str | None:
        """The method's name as documented; Bot API method names are case-insensitive."""
        return self.methods.get(name.lower())

    def field_types(self, method: str) -> Mapping[str, list[str]]:
        return self._fields[method]

    def check_call(self, method: str, params: Mapping[str, Any]) -> list[str]:
        return _problems(self._params[method], dict(params), method)

    def type_fields(self, name: str) -> list[dict[str, Any]]:
        """The documented fields of the type ``name``, each with its description."""
        return list(self._doc["types"][name].get("fields", []))

    @property
    def update_kinds(self) -> list[str]:
        """Every kind of Update (message, edited_message, business_message, ...)."""
        return _update_kinds(self._doc)

    def schema(self, name: str) -> dict[str, Any]:
        """The type ``name`` as JSON Schema, its definitions with it (``tests/fakes/instances``
        makes payloads from it)."""
        return self._with_defs(self._named(name))

    def check_type(self, name: str, value: Any) -> list[str]:
        """What ``value`` breaks in the Bot API's type ``name`` (e.g. an Update a test
        posts to the receiver as Telegram would)."""
        schema = self._types.get(name)
        if schema is None:
            schema = self._types[name] = self._with_defs(self._named(name))
        return _problems(schema, value, name)

    def check_answer(self, method: str, body: Any) -> list[str]:
        """An answer as the Bot API gives it: ``{"ok": true, "result": <what the method
        returns>, "description"?}`` or ``{"ok": false, "error_code", "description",
        "parameters"?}``."""
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
            return [f"answer to {method}: not an object with a boolean 'ok'"]
        if body["ok"] is False:
            return _problems(self._error, body, f"error answer to {method}")
        problems = [f"answer to {method}: unexpected key {k!r}" for k in body if k not in _SUCCESS_KEYS]
        if "result" not in body:
            return [*problems, f"answer to {method}: 'result' is missing"]
        return problems + _problems(self._returns[method], body["result"], f"result of {method}")


def _merge(schema: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def telegram_form_value(value: str, types: list[str]) -> Any:
    """A parameter sent as a query or form value (text on the wire), read the way the Bot
    API reads it: numbers and booleans from their text, arrays and objects as JSON."""
    if "String" in types:
        return value
    if "Integer" in types and re.fullmatch(r"-?\d+", value):
        return int(value)
    if "Float" in types:
        try:
            return float(value)
        except ValueError:
            return value
    if "Boolean" in types or "True" in types:
        return {"true": True, "false": False}.get(value.lower(), value)
    try:
        return json.loads(value)
    except ValueError:
        return value


@functools.cache
def avito_spec() -> OpenApiSpec:
    return OpenApiSpec((_load(name) for name in AVITO_DOCUMENTS), _load(AVITO_OBSERVED))


@functools.cache
def telegram_spec() -> TelegramSpec:
    return TelegramSpec(_load(TELEGRAM_DOCUMENT))


def avito_document() -> dict[str, Any]:
    """Avito's Messenger document as published (its schemas, e.g. WebhookMessage)."""
    return _load(AVITO_DOCUMENTS[0])

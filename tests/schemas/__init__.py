"""The published API schemas the replies are validated against (see README.md here), loaded as
JSON Schema: ``validator("openai", "CreateChatCompletionResponse").validate(reply)``.

OpenAPI 3.0 is not quite JSON Schema: ``nullable: true`` becomes a ``null`` alternative, a
boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` becomes the number form. OpenAPI 3.1
documents are JSON Schema 2020-12 already. ``discriminator`` is an annotation jsonschema
ignores; the ``oneOf`` beside it does the work.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker

HERE = Path(__file__).parent


def _to_json_schema(node: Any) -> Any:
    """An OpenAPI 3.0 schema as JSON Schema 2020-12 (3.1 schemas pass through unchanged)."""
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _to_json_schema(value) for key, value in node.items()}
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        # (a false one is dropped; a true one takes the limit's number)
        if isinstance(out.get(bound), bool) and out.pop(bound) and limit in out:
            out[bound] = out.pop(limit)
    if out.pop("nullable", False):
        kind = out.get("type")
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        if isinstance(kind, str):
            out["type"] = [kind, "null"]
        elif isinstance(kind, list):
            out["type"] = [*kind, "null"] if "null" not in kind else kind
        else:  # a $ref, allOf, anyOf or oneOf: null is one more alternative
            return {"anyOf": [out, {"type": "null"}]}
    return out


# Where a published document contradicts its own API, the correction, each with its reason
# (README.md lists them): (document, path to the node in components.schemas, new node).
ERRATA: list[tuple[str, tuple[str | int, ...], Any]] = [
    # 2026-04-24 types the echoed json_schema format's schema as null only; the specification's
    # source (schema/components/schemas/JsonSchemaResponseFormat.json) says object or null.
    (
        "openresponses",
        ("JsonSchemaResponseFormat", "properties", "schema"),
        {"anyOf": [{"type": "object"}, {"type": "null"}]},
    ),
    # The two Responses documents disagree on the echoed json_schema format's description:
    # Open Responses requires the key and allows null, OpenAI's lets it be left out but not
    # null. Replies follow Open Responses, so OpenAI's is checked with null allowed there.
    (
        "openai",
        ("TextResponseFormatJsonSchema", "properties", "description"),
        {"type": "string", "nullable": True},
    ),
    # OpenAI's Response types usage as an object, never null, yet the document's own
    # response.created stream example sends "usage": null while the response is in progress
    # (Open Responses requires the key and allows null there).
    (
        "openai",
        ("Response", "allOf", 2, "properties", "usage"),
        {"$ref": "#/components/schemas/ResponseUsage", "nullable": True},
    ),
]


def _completion_chunk(schemas: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's document names ``CreateCompletionResponse`` for a completions stream's chunks
    but types its ``finish_reason`` non-null, which OpenAI's own streams send as null until
    the last chunk: the same schema with a null ``finish_reason`` allowed."""
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    return chunk


@functools.cache
def document(name: str) -> dict[str, Any]:
    """``tests/schemas/<name>.json`` as one JSON Schema document (its ``components``), with
    its errata applied."""
    raw = json.loads((HERE / f"{name}.json").read_text())
    schemas = raw["components"]["schemas"]
    for where, path, node in ERRATA:
        if where == name:
            parent: Any = schemas
            for key in path[:-1]:
                parent = parent[key]
            assert path[-1] in parent, f"erratum {path} no longer applies"
            parent[path[-1]] = node
    if name == "openai":
        schemas["CreateCompletionStreamResponse"] = _completion_chunk(schemas)
    return {"components": _to_json_schema(raw["components"])}


def validator(name: str, schema: str | dict[str, Any]) -> Draft202012Validator:
    """A validator for the component ``schema`` of document ``name`` (or for a schema of
    its own that refers to the document's components as ``#/components/schemas/X``)."""
    root = dict(document(name))
    if isinstance(schema, str):
        root["$ref"] = f"#/components/schemas/{schema}"
    else:
        root.update(schema)
    Draft202012Validator.check_schema(root)
    return Draft202012Validator(root, format_checker=FormatChecker())


def errors(name: str, schema: str | dict[str, Any], instance: Any) -> list[str]:
    """Every way ``instance`` fails the schema, one line each (path: message); [] when valid."""
    found = validator(name, schema).iter_errors(instance)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message[:300]}"
        for e in sorted(found, key=lambda e: list(map(str, e.absolute_path)))
    ]

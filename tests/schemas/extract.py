"""Extract the schemas the API tests validate against from the published OpenAPI documents.

Each output file is ``{"source": ..., "components": {"schemas": {...}}}``: the named schemas and
every schema they reach through ``$ref``, copied verbatim (descriptions and examples dropped to
keep the files small), so that ``#/components/schemas/X`` resolves inside the file. The
OpenAPI 3.0 -> JSON Schema conversion (``nullable``) happens when the tests load them
(``tests/schemas/__init__.py``), not here: the files stay the published text.

    python tests/schemas/extract.py SPECS_DIR   # SPECS_DIR: llm_comply/specs of llm-comply 0.5.0
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
DROPPED = {"description", "example", "examples", "x-oaiMeta", "x-stainless-renameMap"}

# output name -> (source file in the package, what upstream published it, root schemas;
# a root may be a shell pattern)
TARGETS: dict[str, tuple[str, str, list[str]]] = {
    "openai": (
        "openai_chat.json",
        "OpenAI's OpenAPI document (openai/openai-openapi), info.version 2.3.0",
        [
            "CreateChatCompletionResponse",
            "CreateChatCompletionStreamResponse",
            "CreateCompletionResponse",
            "ErrorResponse",
            "Response",
            "ResponseStreamEvent",
        ],
    ),
    "openresponses": (
        "openresponses.json",
        "the Open Responses specification (openresponses/openresponses, "
        "public/openapi/openapi.json), info.version 2026-04-24",
        ["ResponseResource", "ErrorPayload", "*StreamingEvent"],
    ),
    "anthropic": (
        "anthropic.json",
        "Anthropic's OpenAPI document of its API (the one its SDKs are generated from)",
        ["Message", "MessageStreamEvent", "CountMessageTokensResponse", "ErrorResponse"],
    ),
}


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = set()
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            found.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node)) if node else set()
    return set()


def _strip_schema(node: Any) -> Any:
    """Drop documentation keys from a schema, not property names that happen to match them."""
    if isinstance(node, list):
        return [_strip_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DROPPED:
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(
            value, dict
        ):
            out[key] = {name: _strip_schema(sub) for name, sub in value.items()}
        else:
            out[key] = _strip_schema(value)
    return out


def extract(document: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    wanted: dict[str, Any] = {}
    todo = [name for root in roots for name in sorted(fnmatch.filter(schemas, root))]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted[name] = _strip_schema(schemas[name])
        todo.extend(_refs(schemas[name]) - wanted.keys())
    return {name: wanted[name] for name in sorted(wanted)}


def main(specs: Path) -> None:
    for out, (filename, upstream, roots) in TARGETS.items():
        raw = (specs / filename).read_bytes()
        document = json.loads(raw)
        body = {
            "source": {
                "upstream": upstream,
                "openapi": document["openapi"],
                "info": document.get("info", {}).get("version"),
                "shipped_in": f"PyPI llm-comply 0.5.0, llm_comply/specs/{filename}",
                "sha256": hashlib.sha256(raw).hexdigest(),
            },
            "components": {"schemas": extract(document, roots)},
        }
        path = HERE / f"{out}.json"
        path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        count = len(body["components"]["schemas"])
        print(f"{path.name}: {count} schemas, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

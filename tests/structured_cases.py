"""JSON schemas the structured-output tests run on every path.

Small and bounded (enums, short strings, bounded integers, fixed-size arrays) so that a model
with random weights, which only the grammar keeps valid, finishes each one by the grammar's
own end well within ``MAX_TOKENS``.
"""

from __future__ import annotations

import json
from typing import Any

MAX_TOKENS = 200

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                    "kind": {"enum": ["home", "work"]},
                },
                "required": ["zip", "kind"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["count", "ok", "color"],
        "additionalProperties": False,
    },
}

# A long output (a worker is killed while it streams): 24 enum items, ~150 tokens.
LONG_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {"enum": ["alpha", "beta", "gamma"]},
    "minItems": 24,
    "maxItems": 24,
}
LONG_MAX_TOKENS = 400


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` for ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def spec_text(schema: dict[str, Any]) -> str:
    """How the router serialises a schema into ``StructuredOutput.spec``."""
    return json.dumps(schema, ensure_ascii=False)

"""A validator for the part of JSON Schema (2020-12) that ``certificate.schema.json`` uses.

stratagem checks certificates wherever it reads one (``stratagem contract --verify``, the listings, ``stratagem
doctor``), and a listing must stay fast and light: a full JSON Schema library would be a run-time dependency
for a dozen keywords. The tests validate the schema and real certificates with ``jsonschema`` as well, and check
that both validators agree (``core/tests/test_certificate.py``). A keyword this module does not implement is
refused rather than ignored, so the schema cannot silently grow past it.
"""

from __future__ import annotations

import re
from typing import Any

#: Keywords that only document or hold definitions.
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "$defs", "title", "description"})
_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    ),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_KEYWORDS = frozenset(
    {
        "$ref",
        "type",
        "const",
        "enum",
        "pattern",
        "minLength",
        "minimum",
        "minItems",
        "items",
        "properties",
        "required",
        "additionalProperties",
        "if",
        "then",
        "else",
    }
)


def validate(instance: Any, schema: dict[str, Any]) -> list[str]:
    """The problems of ``instance`` against ``schema``, each with the JSON path it concerns (empty: valid)."""
    problems: list[str] = []
    _check(instance, schema, schema, "$", problems)
    return problems


def _equal(a: Any, b: Any) -> bool:
    # JSON equality: true is not 1.
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _check(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str, out: list[str]) -> None:
    unknown = set(schema) - _KEYWORDS - _ANNOTATIONS
    if unknown:
        raise ValueError(f"certificate schema at {path}: keywords {sorted(unknown)} are not implemented")
    if "$ref" in schema:
        _check(value, _resolve(root, schema["$ref"]), root, path, out)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            out.append(f"{path}: expected {' or '.join(types)}, got {type(value).__name__} {value!r}"[:300])
            return
    if "const" in schema and not _equal(value, schema["const"]):
        out.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and not any(_equal(value, option) for option in schema["enum"]):
        out.append(f"{path}: expected one of {schema['enum']}, got {value!r}")
    if isinstance(value, str):
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            out.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if len(value) < schema.get("minLength", 0):
            out.append(f"{path}: expected at least {schema['minLength']} characters, got {value!r}")
    if _TYPES["number"](value) and "minimum" in schema and value < schema["minimum"]:
        out.append(f"{path}: expected at least {schema['minimum']}, got {value!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{path}: expected at least {schema['minItems']} items, got {len(value)}")
        if "items" in schema:
            for index, item in enumerate(value):
                _check(item, schema["items"], root, f"{path}[{index}]", out)
    if isinstance(value, dict):
        _check_object(value, schema, root, path, out)
    if "if" in schema:
        trial: list[str] = []
        _check(value, schema["if"], root, path, trial)
        branch = schema.get("then") if not trial else schema.get("else")
        if branch is not None:
            _check(value, branch, root, path, out)


def _check_object(
    value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], path: str, out: list[str]
) -> None:
    for key in schema.get("required", ()):
        if key not in value:
            out.append(f"{path}: missing {key!r}")
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            _check(item, properties[key], root, f"{path}.{key}", out)
        elif extra is False:
            out.append(f"{path}: unexpected {key!r}")
        elif isinstance(extra, dict):
            _check(item, extra, root, f"{path}.{key}", out)


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"certificate schema: only local references are implemented, got {ref!r}")
    target: Any = root
    for part in ref[2:].split("/"):
        target = target[part]
    return target

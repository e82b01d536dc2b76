"""A small JSON-schema checker for the tests' schemas (no jsonschema dependency): the keywords
the structured-output tests use — type, properties, required, additionalProperties (strict:
no property the schema lacks), enum, const, anyOf, minimum / maximum, minLength / maxLength,
pattern, items, minItems / maxItems. Returns a list of problems (empty: valid)."""
from __future__ import annotations

import re

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def problems(value, schema: dict, path: str = "$") -> list[str]:
    out: list[str] = []
    if "anyOf" in schema:
        if all(problems(value, s, path) for s in schema["anyOf"]):
            out.append(f"{path}: matches no anyOf branch")
        return out
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: {value!r} != const {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    t = schema.get("type")
    if t == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return out + [f"{path}: {value!r} is not an integer"]
    elif t == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return out + [f"{path}: {value!r} is not a number"]
    elif t is not None and not isinstance(value, _TYPES[t]):
        return out + [f"{path}: {value!r} is not {t}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1 << 30):
            out.append(f"{path}: length {len(value)} outside the bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 1 << 30):
            out.append(f"{path}: {len(value)} items outside the bounds")
        for i, v in enumerate(value):
            out += problems(v, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        out += [f"{path}: unexpected {k!r}" for k in value if props and k not in props]
        for k, v in value.items():
            if k in props:
                out += problems(v, props[k], f"{path}.{k}")
    return out

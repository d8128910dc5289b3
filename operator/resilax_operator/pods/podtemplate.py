"""The worker pod template against Kubernetes' own PodTemplateSpec schema; nulls in it are absent.

The CRD embeds the schema (scripts/gen-template-schema writes it into the chart's CRD and, without
descriptions, into `podtemplate_schema.json` here), so the API server refuses a malformed template at
apply. The operator checks again here, with the same schema, because an object may have been stored
before the CRD carried it: whatever the builder would trip over (env as a map, a string
securityContext, a list for labels, ...) becomes an `InvalidSpec` problem naming the field instead of
an exception in every reconcile. Pure: no I/O but reading the packaged schema once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Any, Final

from ..errors import SpecProblem

SCHEMA_FILE: Final = "podtemplate_schema.json"
#: At most this many schema problems are reported for one template (the first ones, in field order).
MAX_PROBLEMS: Final = 20


@functools.cache
def template_schema() -> dict[str, Any]:
    """The structural schema of `spec.template` (the CRD's, without descriptions)."""
    loaded: dict[str, Any] = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())
    return loaded


def check_template_schema(template: Any, path: str = "spec.template") -> list[SpecProblem]:
    """Every place where `template` does not match the PodTemplateSpec schema (types, unknown fields,
    required fields, enums, list bounds), each with its field path; at most MAX_PROBLEMS."""
    out: list[SpecProblem] = []
    for problem in _check(template, template_schema(), path):
        out.append(problem)
        if len(out) >= MAX_PROBLEMS:
            break
    return out


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object (a map)"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


_EXPECTED: Final = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
                    "number": "a number", "boolean": "a boolean"}


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, Mapping)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return True


def _check(value: Any, schema: Mapping[str, Any], path: str) -> Iterator[SpecProblem]:
    if value is None:  # the API server drops nulls of non-nullable fields: absent
        return
    if schema.get("x-kubernetes-int-or-string"):
        if not (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
            yield SpecProblem(path, f"found {_kind(value)} {_shown(value)}; an integer or a string is required "
                                    "(a quantity such as \"500m\", \"1.5\" or 2)")
        return
    kind = schema.get("type")
    if kind is None:  # x-kubernetes-preserve-unknown-fields without a type: anything
        return
    if not _type_ok(value, kind):
        yield SpecProblem(path, f"found {_kind(value)} {_shown(value)}; {_EXPECTED.get(kind, kind)} is required")
        return
    if "enum" in schema and value not in schema["enum"]:
        yield SpecProblem(path, f"{_shown(value)} is not allowed; valid: {', '.join(map(str, schema['enum']))}")
    if kind == "string" and "maxLength" in schema and len(value) > schema["maxLength"]:
        yield SpecProblem(path, f"is {len(value)} characters long; at most {schema['maxLength']} are allowed")
    if kind == "array":
        if "minItems" in schema and len(value) < schema["minItems"]:
            yield SpecProblem(path, f"has {len(value)} items; at least {schema['minItems']} are required")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield SpecProblem(path, f"has {len(value)} items; at most {schema['maxItems']} are allowed")
        items = schema.get("items")
        if items is not None:
            for i, item in enumerate(value):
                yield from _check(item, items, f"{path}[{i}]")
    if kind == "object":
        properties: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        free = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key in schema.get("required") or ():
            if value.get(key) is None:
                yield SpecProblem(f"{path}.{key}", "is required")
        for key, child in value.items():
            where = f"{path}.{key}"
            if key in properties:
                yield from _check(child, properties[key], where)
            elif isinstance(extra, Mapping):
                yield from _check(child, extra, where)
            elif not free:
                near = ", ".join(sorted(properties)) if len(properties) <= 12 else "see kubectl explain"
                yield SpecProblem(where, f"unknown field {key!r}; valid fields here: {near}")


def drop_nulls(value: Any) -> Any:
    """`value` without nulls anywhere: a key whose value is null and a null list item are absent, as the
    API server treats them (it prunes nulls of non-nullable fields; the PodTemplateSpec has no nullable
    one). An object stored before the CRD had its schema may still carry them, and the builders must
    never trip over one (issue 25: `podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution: null`
    crashed every reconcile)."""
    if isinstance(value, Mapping):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value if v is not None]
    return value

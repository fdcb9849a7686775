"""The spec's JSON Schema and its reference page, both generated from the pydantic models (one source).

``trainyard schema`` prints the JSON Schema; ``docs/spec.schema.json`` is that output, which the
example specs name on their first line (``# yaml-language-server: $schema=...``) so an editor with the
YAML language server completes and checks fields as they are typed. ``trainyard schema --markdown``
prints ``docs/spec.md``, the field reference. Tests keep both files equal to what this module makes.
The schema checks shapes and types; the checks across fields (``spec.checks``) are ``trainyard check``'s.
"""

from __future__ import annotations

import json
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from trainyard.spec.models import PipelineSpec

SCHEMA_ID = "https://trainyard.dev/spec.schema.json"


def json_schema() -> dict[str, Any]:
    schema = PipelineSpec.model_json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        **schema,
        "title": "trainyard pipeline spec",
    }


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def markdown_reference() -> str:
    """Every section of the spec as a table (field, type, default, meaning), from the models and their docstrings."""
    lines = [
        "# Spec reference",
        "",
        "Generated from the spec's models (`trainyard schema --markdown > docs/spec.md`); the JSON Schema an",
        "editor uses is `docs/spec.schema.json` (`trainyard schema`). `trainyard check FILE` checks a spec",
        "against these and against the rules across fields.",
        "",
    ]
    for path, model in _sections(PipelineSpec, ""):
        lines += [f"## `{path or 'top level'}`", ""]
        if model.__doc__ and model is not PipelineSpec and not model.__doc__.startswith(model.__name__ + "("):
            lines += [" ".join(model.__doc__.split()), ""]
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            key = field.alias or name
            default = "(required)" if field.is_required() else f"`{_default(field)}`"
            meaning = " ".join((field.description or "").split()).replace("|", "\\|")
            lines.append(f"| `{key}` | {_type(field.annotation, field.json_schema_extra)} | {default} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _sections(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    out = [(path, model)]
    for name, field in model.model_fields.items():
        for sub in _models(field.annotation):
            out += _sections(sub, f"{path}.{field.alias or name}" if path else field.alias or name)
    seen: set[str] = set()
    return [(p, m) for p, m in out if not (p in seen or seen.add(p))]  # type: ignore[func-returns-value]


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models(arg)]


def _type(annotation: Any, extra: Any = None) -> str:
    """``extra``: the field's JSON Schema additions; an ``enum`` there (a vocabulary others may add to, such as
    ``nodes.backend``) is its type."""
    enum = extra.get("enum") if isinstance(extra, dict) else None
    return f"`{'one of ' + ', '.join(map(str, enum)) if enum else _name(annotation)}`".replace("|", "\\|")


def _name(annotation: Any) -> str:
    """A field's type as a reader of YAML thinks of it: ``int``, ``str or null``, ``one of a, b``, ``list of str``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (Union, UnionType):
        return " or ".join("null" if a is type(None) else _name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_name(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "{...}"
    return json.dumps(value, default=str)

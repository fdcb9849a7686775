"""Error wording: pydantic's validation errors as ``field.path: what is wrong and what is allowed``.

Each line names the field (``nodes.kubernetes.namespace``, ``notify.email[1]``)
and says what to write instead; a rule a field's own validator states (a
pattern, a label key, a service account) is quoted as the validator wrote it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, get_args

from pydantic import ValidationError

from trainyard.spec.models import PipelineSpec

_RANGES = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def describe(exc: ValidationError) -> list[str]:
    """One ``field.path: message`` line per error of ``exc``."""
    return [_line(dotted(err["loc"]), message(err)) for err in exc.errors()]


def _line(field: str, text: str) -> str:
    # A validator of a whole tree (``training.args``) starts its message with the place inside it.
    return f"{field}{text}" if text[:1] in (".", "[") and ": " in text else f"{field}: {text}"


def dotted(loc: tuple[Any, ...]) -> str:
    """``('notify', 'email', 1)`` as ``notify.email[1]``."""
    out = ""
    for part in loc:
        if part == "[key]":
            continue  # pydantic's marker for "the key of this mapping"; the key is already named
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def message(err: Mapping[str, Any]) -> str:
    kind, value = err["type"], err.get("input")
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        allowed = allowed_fields(err["loc"][:-1])
        return f"unknown field{did_you_mean(str(err['loc'][-1]), allowed)}; allowed here: {', '.join(allowed)}"
    msg: str = err["msg"]
    if kind == "literal_error":
        return f"{show(value)} is not allowed; expected {msg.removeprefix('Input should be ')}"
    if kind in _RANGES:
        return f"{show(value)} is out of range; it should be {msg.removeprefix('Input should be ')}"
    if kind == "finite_number":
        return f"{show(value)} is not allowed; write a finite number (no .inf or .nan)"
    if kind == "value_error":  # our own validators: the message already says what to write
        return msg.removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":  # a field without a rule of its own: quote the pattern itself
        return f"{show(value)} does not match the pattern {err.get('ctx', {}).get('pattern')!r}"
    return msg[0].lower() + msg[1:] + f" (got {show(value)})"


def did_you_mean(word: str, choices: list[str]) -> str:
    """`` (did you mean 'count'?)`` for the closest of ``choices`` to a typo, or nothing."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def yaml_hint(problem: str, line: str) -> str:
    """What to do about a YAML syntax error, from PyYAML's ``problem`` and the source ``line`` it is on."""
    if "\\t" in problem or "\t" in line[: len(line) - len(line.lstrip())]:
        return "; YAML indents with spaces, never tabs: replace the tab with spaces"
    key, colon, value = line.partition(":")
    if colon and value.strip().startswith("*"):
        return (
            "; a value starting with '*' is read as a YAML alias (a reference to an '&' anchor); quote it:"
            f" {key.strip()}: '{value.strip()}'"
        )
    if "alias" in problem:
        return "; '*' starts a YAML alias (a reference to an '&' anchor): quote a value that starts with '*'"
    return ""


def allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model at ``loc`` in the spec tree (empty where ``loc`` is no model)."""
    model: Any = PipelineSpec
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list of models (dataset.files[0]): the model is the list's item type
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = next((a for a in (field.annotation, *get_args(field.annotation)) if hasattr(a, "model_fields")), None)
    return sorted(getattr(model, "model_fields", {}))


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def type_name(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__
    )

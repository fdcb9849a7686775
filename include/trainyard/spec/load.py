"""Loading: spec text -> a validated ``PipelineSpec``, or one ``SpecError`` listing every problem.

``load_spec`` turns any bad file into a ``SpecError`` whose lines read ``FILE:
field.path: what is wrong and what is allowed`` -- never a traceback. YAML is
read with a ``yaml.SafeLoader`` that also refuses duplicate keys. A structural
error does not hide the cross-field ones: the broken fields are set aside
(their defaults stand in where they have one) and every check that does not
read them still runs. ``with_params`` applies a trigger's Params through the
same validation, so a run can never use a spec ``trainyard check`` refuses.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainyard.errors import SpecError
from trainyard.spec.args import resolve_relative, with_arg
from trainyard.spec.checks import cross_field_problems
from trainyard.spec.messages import describe, type_name, yaml_hint
from trainyard.spec.models import PipelineSpec


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses duplicate keys (the last one would win silently)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}; each key may appear once", key_node.start_mark
            )
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node, deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def parse_yaml(text: str) -> Any:
    """Parse spec text; ``ValueError`` carries ``line L, column C: problem``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        lines = text.splitlines()
        line = lines[mark.line] if mark and mark.line < len(lines) else ""
        problem = str(exc.problem or exc.context)
        raise ValueError(f"{where}invalid YAML: {problem}{yaml_hint(problem, line)}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"invalid YAML: {exc}") from None


def load_spec(path: str | Path) -> PipelineSpec:
    """Read and validate one spec file; ``SpecError`` lists every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([f"{path}: cannot read the file: {exc}"]) from None
    return spec_from_text(text, path)


def spec_from_text(text: str, path: Path) -> PipelineSpec:
    try:
        data = parse_yaml(text)
    except ValueError as exc:
        raise SpecError([f"{path}: {exc}"]) from None
    if data is None:
        raise SpecError([f"{path}: the file is empty; a spec needs at least dataset, nodes and training"])
    if not isinstance(data, dict):
        raise SpecError([f"{path}: the top level must be a mapping of fields, not a {type_name(data)}"])
    return spec_from_data(data, path)


def spec_from_data(data: Mapping[str, Any], path: Path) -> PipelineSpec:
    data = resolve_relative(data, Path(path).parent)
    try:
        spec = PipelineSpec.model_validate(data)
    except ValidationError as exc:
        problems = describe(exc)
        salvaged, broken = _without_broken_fields(data, exc)
        if salvaged is not None:
            problems += cross_field_problems(salvaged, broken)
        raise SpecError([f"{path}: {line}" for line in problems]) from None
    problems = cross_field_problems(spec)
    if problems:
        raise SpecError([f"{path}: {line}" for line in problems])
    return spec


# Enough rounds for any real file: each one sets aside at least one key.
_SALVAGE_ROUNDS = 32


def _without_broken_fields(data: Mapping[str, Any], exc: ValidationError) -> tuple[PipelineSpec | None, list[str]]:
    """The spec with every broken field left out (its default stands in), and those fields' dotted paths.

    A required field (or section) takes its value from ``STAND_IN``, so a typo in
    ``nodes.count`` does not hide the checks of ``training``; one without a
    stand-in has its parent left out next, up to a required section, where
    salvage stops (None) and only the structural errors are reported. A stand-in
    is never judged: every check reading it is skipped as broken.
    """
    tree = copy.deepcopy(dict(data))
    broken: list[str] = []
    for _ in range(_SALVAGE_ROUNDS):
        removed = False
        for err in exc.errors():
            if err["type"] == "missing" and _stand_in(tree, err["loc"]):
                broken.append(".".join(map(str, err["loc"])))
                removed = True
                continue
            keys = _present(tree, err["loc"][:-1] if err["type"] == "missing" else err["loc"])
            if keys and err["type"] != "extra_forbidden":
                broken.append(".".join(map(str, keys)))
            if keys and _remove(tree, keys):
                removed = True
        if not removed:
            return None, broken
        try:
            return PipelineSpec.model_validate(tree), broken
        except ValidationError as again:
            exc = again
    return None, broken


# Valid values for the required fields, by path: placeholders that let the rest of a broken file be checked.
STAND_IN: dict[str, Any] = {
    "dataset": {"source": "file:///stand-in", "name": "stand-in"},
    "nodes": {"count": 1},
    "training": {"max_steps": 1, "global_batch": 1, "micro_batch": 1, "checkpoint_every": 1},
}


def _stand_in(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    """Put ``STAND_IN``'s value at ``loc`` into ``data``; False where it has none or the parent is no mapping."""
    node: Any = data
    value: Any = STAND_IN
    for part in loc[:-1]:
        if not (isinstance(value, dict) and part in value and isinstance(node, dict)):
            return False
        node, value = node.setdefault(part, {}), value[part]
    if not (isinstance(node, dict) and isinstance(value, dict) and loc[-1] in value):
        return False
    node[loc[-1]] = copy.deepcopy(value[loc[-1]])
    return True


def _present(data: dict[str, Any], loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The longest prefix of ``loc`` that walks mapping keys of ``data``.

    The walk stops at a list: one broken item sets aside the whole list (its key).
    """
    node: Any = data
    path: tuple[str, ...] = ()
    for part in loc:
        if not (isinstance(node, dict) and part in node):
            break
        path, node = (*path, part), node[part]
    return path


def _remove(data: dict[str, Any], keys: tuple[str, ...]) -> bool:
    node: Any = data
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None  # an earlier removal may have taken it
    return isinstance(node, dict) and node.pop(keys[-1], _GONE) is not _GONE


_GONE = object()


def spec_files(paths: Iterable[str | Path]) -> list[Path]:
    """The spec files ``paths`` name: a folder stands for its ``*.yaml`` files, as the DAG folder is read."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("*.y*ml")) if path.is_dir() else [path]
    return files


# ---------------------------------------------------------------- trigger Params

# Each UI Param overrides one spec field (a path into the spec tree); the
# override is validated by the same models, so a trigger can never run a spec
# that ``trainyard check`` would refuse.
PARAM_FIELDS: dict[str, tuple[str, ...]] = {
    "nodes": ("nodes", "count"),
    "min_nodes": ("nodes", "min"),
    "max_steps": ("training", "max_steps"),
    "micro_batch": ("training", "micro_batch"),
    "lr": ("training", "args", "lr"),
    "resume_from": ("training", "resume_from"),
}


def with_params(spec: PipelineSpec, params: Mapping[str, Any], source: Path) -> PipelineSpec:
    """The spec with a trigger's Params applied; ``SpecError`` names the Param's field."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    for name, value in params.items():
        if name not in PARAM_FIELDS or name not in spec.params:
            continue  # Airflow's own params (and ones this spec does not expose) pass by
        *parents, field = PARAM_FIELDS[name]
        node = data
        for key in parents[:-1] if parents[-1:] == ["args"] else parents:
            node = node.setdefault(key, {})
        if parents[-1:] == ["args"]:  # a mapping or a list of items (``spec.args``)
            node["args"] = with_arg(node.get("args"), field, value)
        else:
            node[field] = value
    return spec_from_data(data, source)

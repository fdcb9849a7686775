"""Dataset folders: whether a dataset name is fit as a folder of its own under the hot root, and which specs'
folders may nest.

``dataset_name_problems`` runs on the spec's text and again at run time on
the rendered name (a template can render to what the spec check could not
see); ``nested_specs`` relates the specs of one folder (a stage or an
eviction of one dataset must never touch another's files). Every line
starts with the field it is about.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from trainyard.spec.models import PipelineSpec
from trainyard.spec.templating import ENV_REF, TEMPLATE, render


def dataset_name_problems(name: str, template: str | None = None) -> list[str]:
    """What makes ``name`` unfit as a dataset folder under the hot root (empty when fit).

    Called on the spec's text and again at run time on the rendered name (pass the
    spec's ``template`` then): a folder trainyard stages into, and may evict, must
    be a plain relative path of its own, never the root itself or outside it.
    """
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or ".." in parts:
        return [f"{name!r} escapes the hot root; use a relative key without '..' (e.g. tokens/{{{{ ds }}}})"]
    if "." in parts or "" in parts:
        return [
            f"{name!r} has an empty or '.' part; name a folder of its own under the hot root (e.g. tokens/{{{{ ds }}}})"
        ]
    if template is not None and len(parts) != len(template.split("/")):
        return [
            f"{name!r} (from {template!r}) has more parts than its template: a placeholder rendered a '/';"
            " each placeholder must render within one path part"
        ]
    return []


def nested_roots(specs: Mapping[Path, PipelineSpec]) -> list[str]:
    """A line for each spec whose dataset folder may lie inside (or around) another spec's."""
    return list(nested_specs(specs).values())


def nested_specs(specs: Mapping[Path, PipelineSpec]) -> dict[Path, str]:
    """``{spec path: why}`` for each spec whose dataset folder may lie inside (or around) an earlier spec's.

    Folders are compared as whole paths (hot root, then name), so a hot root inside
    another's counts too. Templates and ``${VAR}`` match any value within their path
    part (``tokens`` nests with ``tokens/{{ ds }}``). Two specs naming the same
    source and folder share one staged copy on purpose, and pass.
    """
    folders = [(path, spec, _folder(spec)) for path, spec in specs.items()]
    problems = {}
    for i, (path, spec, folder) in enumerate(folders):
        for other_path, other, other_folder in folders[:i]:
            same = (spec.dataset.source, spec.dataset.name) == (other.dataset.source, other.dataset.name)
            if not same and _may_overlap(folder, other_folder):
                problems[path] = (
                    f"{path}: dataset.name: {spec.dataset.name!r} may be the folder of, inside or around"
                    f" {other_path.name}'s dataset {other.dataset.name!r} (dataset.hot and dataset.name together);"
                    " dataset folders must not nest (staging or evicting one would touch the other's files):"
                    " rename one"
                )
                break
    return problems


def _folder(spec: PipelineSpec) -> list[str]:
    """The path parts of the dataset's hot folder: the hot root's, then the name's."""
    try:  # the hot root holds no run templates (its own check); ${VAR} as on this machine
        hot = render(spec.dataset.hot, {})
    except KeyError:
        hot = spec.dataset.hot
    root = os.path.normpath(hot.removeprefix("file://"))
    return [p for p in root.split("/") if p] + [p for p in spec.dataset.name.split("/") if p]


def _may_overlap(a: list[str], b: list[str]) -> bool:
    """Whether one folder may be the other or lie inside it: every shared part may be equal."""
    return all(_may_equal(x, y) for x, y in zip(a, b))


def _may_equal(x: str, y: str) -> bool:
    (x_head, x_tail), (y_head, y_tail) = _ends(x), _ends(y)
    if x_tail is None:
        return x == y if y_tail is None else _fits(x, y_head, y_tail)
    if y_tail is None:
        return _fits(y, x_head, x_tail)
    heads_fit = x_head.startswith(y_head) or y_head.startswith(x_head)
    return heads_fit and (x_tail.endswith(y_tail) or y_tail.endswith(x_tail))


def _fits(literal: str, head: str, tail: str) -> bool:
    """Whether a literal part can be what a part with placeholders (``head``...``tail``) renders to."""
    return len(literal) >= len(head) + len(tail) and literal.startswith(head) and literal.endswith(tail)


def _ends(part: str) -> tuple[str, str | None]:
    """A part's literal text before its first and after its last placeholder; (part, None) without one."""
    spans = [m.span() for m in (*TEMPLATE.finditer(part), *ENV_REF.finditer(part))]
    if not spans:
        return part, None
    return part[: min(s for s, _ in spans)], part[max(e for _, e in spans) :]

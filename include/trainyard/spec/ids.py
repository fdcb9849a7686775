"""DAG ids of pipeline specs: the rules a folder of specs must keep for Airflow to load every pipeline.

A spec's DAG id is its ``pipeline:`` field, else its file name without ``.yaml``
(``PipelineSpec.dag_id``). Airflow refuses an id outside ``KEY_PATTERN`` with a
``ValueError`` while it builds the DAG, which would fail ``dags/pipelines.py``
and hide every pipeline; and of two specs with one id it keeps one, so a new
file would silently replace a running pipeline. Both are checked here, without
Airflow, by ``trainyard check`` and by the DAG folder's scan alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from trainyard.spec.load import parse_yaml
from trainyard.spec.models import PipelineSpec

# Airflow's own rule (``airflow.sdk.definitions._internal.node.KEY_REGEX`` and ``validate_key``'s length).
KEY_PATTERN = re.compile(r"[\w.-]+\Z")
MAX_DAG_ID = 250


def dag_id_problems(path: Path, spec: PipelineSpec | None) -> list[str]:
    """Why ``spec`` read from ``path`` has no usable DAG id (one ``field: message`` line), or nothing.

    ``spec`` None: the file is invalid, but its name is told too unless it sets ``pipeline:`` (told apart by
    reading the file again; a file that cannot be read or parsed is told why already).
    """
    if spec.pipeline is not None if spec is not None else _names_pipeline(path):
        return []  # the field's own pattern keeps it a valid id
    stem = path.stem
    if KEY_PATTERN.match(stem) and len(stem) <= MAX_DAG_ID:
        return []
    return [
        f"pipeline: the file name {path.name!r} gives the DAG id {stem!r}, which Airflow refuses (letters, digits,"
        f" '_', '.' and '-', at most {MAX_DAG_ID} characters); rename the file (e.g. {suggest(stem)}{path.suffix})"
        " or set pipeline: to a valid id"
    ]


def _names_pipeline(path: Path) -> bool:
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return True  # unreadable: its one line says so
    return not isinstance(data, dict) or "pipeline" in data


def suggest(stem: str) -> str:
    """``stem`` with every character Airflow refuses turned into ``_``."""
    return re.sub(r"[^\w.-]", "_", stem)[:MAX_DAG_ID] or "pipeline"


def duplicate_ids(specs: Mapping[Path, PipelineSpec]) -> dict[Path, str]:
    """Each spec that may not have the DAG id another one has too, with its problem line. The one that keeps it
    is the spec whose file is named after the id (``nightly_pretrain.yaml``: a copy of it under a new name that
    still says ``pipeline: nightly_pretrain`` must not take its DAG over), else the first in file-name order (as
    the DAG folder is read)."""
    by_id: dict[str, list[Path]] = {}
    for path in sorted(specs):
        by_id.setdefault(specs[path].dag_id(path), []).append(path)
    problems: dict[Path, str] = {}
    for dag_id, paths in by_id.items():
        keeper = next((p for p in paths if p.stem == dag_id), paths[0])
        for path in paths:
            if path != keeper:
                problems[path] = (
                    f"pipeline: DAG id {dag_id!r} is already used by {keeper.name}; Airflow would keep one of"
                    " the two: give this spec a pipeline: id of its own"
                )
    return problems

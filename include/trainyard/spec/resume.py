"""Where a run may resume from: the shape of ``training.resume_from``, and whether a path lies inside the
pipeline's own checkpoint folders or its ``training.allowed_resume_roots``.

``resume_problems`` runs at run time on rendered roots (``pipeline.run``);
the spec check of the field's shape (``spec.checks``) uses ``resume_shape``.
A run must never read another pipeline's checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from trainyard.spec.models import PipelineSpec


def resume_shape(value: str) -> list[str]:
    """The problem with ``training.resume_from``'s shape, if any (``valid_resume``)."""
    if not valid_resume(value):
        return [f"training.resume_from: {value!r} must be 'latest', 'none' or an absolute checkpoint path"]
    return []


def valid_resume(value: str) -> bool:
    """'latest', 'none' or an absolute path without '..' (the shape; ``resume_problems`` checks the place)."""
    return value in ("latest", "none") or (value.startswith("/") and ".." not in PurePosixPath(value).parts)


def resume_root_fields(spec: PipelineSpec) -> list[tuple[str, str]]:
    """(field, URI as written) of each ``training.allowed_resume_roots`` entry; a bare path as ``file://``."""
    return [
        (f"training.allowed_resume_roots[{i}]", root if "://" in root else "file://" + root)
        for i, root in enumerate(spec.training.allowed_resume_roots)
    ]


def resume_problems(spec: PipelineSpec, resume_from: str, roots: Sequence[str | Path]) -> list[str]:
    """Why the run may not resume from ``resume_from`` (empty when it may).

    ``roots`` are rendered: the pipeline's own checkpoint folders (hot, and cold
    where it is a ``file://`` URI) and its rendered ``allowed_resume_roots``. A
    path must lie inside one of them both as written and with its links
    resolved. The message is the same whether or not the path exists, so the
    check tells a trigger nothing about folders it may not read.
    """
    if resume_from in ("latest", "none") or not valid_resume(resume_from):
        return resume_shape(resume_from)
    folders = [str(r).removeprefix("file://") for r in roots if "://" not in str(r) or str(r).startswith("file://")]
    if any(_inside(resume_from, folder) for folder in folders):
        return []
    if spec.training.allowed_resume_roots:
        fix = "or from inside one of training.allowed_resume_roots, or add the folder that holds it there"
    else:
        fix = "or list the folder that holds it in training.allowed_resume_roots"
    return [
        f"training.resume_from: {resume_from!r} is outside this pipeline's checkpoint folders and"
        f" training.allowed_resume_roots; resume from this pipeline's own checkpoints {fix}"
    ]


def _inside(path: str, root: str) -> bool:
    def within(p: str, r: str) -> bool:  # strictly below: a checkpoint root itself is no checkpoint
        return p.startswith(r.rstrip("/") + "/")

    return within(os.path.normpath(path), os.path.normpath(root)) and within(
        os.path.realpath(path), os.path.realpath(root)
    )

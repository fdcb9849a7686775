"""Where a run may resume from: its pipeline's own checkpoint roots, and those the spec allows.

``training.resume_from`` is also a Param, so whoever may trigger a DAG may
set it. The orchestrator verifies the path it names and hands it to training
code, so an unconfined path reads another pipeline's checkpoints, and the
error about it would tell whether a folder exists. A path is accepted only
if, with symbolic links and ``..`` resolved, it lies below the pipeline's
hot checkpoint root, its cold root (when that is ``file://``) or one of
``training.allowed_resume_roots``; the refusal reads the same whether the
path exists or not. ``run.open_run`` checks it when the run starts, before
staging and burn-in; ``stages.resume_point`` again when it decides.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.errors import SpecError

if TYPE_CHECKING:
    from trainyard.run import Run

KEYWORDS = ("latest", "none")


def resume_outside_roots(resume_from: str, roots: Sequence[Path]) -> list[str]:
    """Why ``resume_from`` may not be resumed from (empty: it may): a path not below one of ``roots``.

    Both sides are resolved (links, ``..``) first, so a link under a root
    that points elsewhere counts as elsewhere.
    """
    if resume_from in KEYWORDS:
        return []
    target = Path(os.path.realpath(resume_from))
    if any(target != root and target.is_relative_to(root) for root in (Path(os.path.realpath(r)) for r in roots)):
        return []
    listed = ", ".join(str(r) for r in roots)
    return [f"training.resume_from: {resume_from!r} is not below this pipeline's checkpoint roots ({listed});"
            " resume from a checkpoint there, or add the folder that holds it to training.allowed_resume_roots"]


def resume_roots(run: Run) -> tuple[list[Path], list[str]]:
    """The folders ``run`` may resume from, and what is wrong with the spec's ``allowed_resume_roots``."""
    from trainyard.storage import local_path

    roots, problems = [run.checkpoint_root], []
    cold = run.cold_checkpoint_uri
    if cold.startswith("file://"):
        roots.append(Path(local_path(cold)))
    for i, text in enumerate(run.spec.training.allowed_resume_roots):
        name = f"training.allowed_resume_roots[{i}]"
        value = run.resolve(name, text)
        path = Path(local_path(value) if value.startswith("file://") else value)
        if not path.is_absolute() or ".." in path.parts:
            problems.append(f"{name}: {text!r} must be an absolute folder path without '..'")
        else:
            roots.append(path)
    return roots, problems


def check_resume(run: Run) -> None:
    """``SpecError`` (naming the spec file) unless the run's ``resume_from`` is inside its allowed roots."""
    roots, problems = resume_roots(run)
    problems += resume_outside_roots(run.spec.training.resume_from, roots)
    if problems:
        raise SpecError([f"{run.spec_path}: {p}" for p in problems])

"""Where a run may resume from: its pipeline's own checkpoint roots, and those the spec allows.

``training.resume_from`` is also a Param, so whoever may trigger a DAG may
set it. The orchestrator verifies the path it names and hands it to training
code, so an unconfined path reads another pipeline's checkpoints, and the
error about it would tell whether a folder exists. A path is accepted only
if, with symbolic links and ``..`` resolved, it lies below the pipeline's
hot checkpoint root, its cold root (when that is ``file://``) or one of
``training.allowed_resume_roots``; the refusal reads the same whether the
path exists or not. The rule is ``spec.checks.resume_problems``; this module
finds the run's rendered roots. ``run.open_run`` checks it when the run
starts, before staging and burn-in; ``stages.resume_point`` again when it
decides.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.errors import SpecError
from trainyard.spec.checks import resume_problems, resume_root_fields

if TYPE_CHECKING:
    from trainyard.run import Run


def resume_roots(run: Run) -> tuple[list[Path], list[str]]:
    """The folders ``run`` may resume from, and what is wrong with the spec's ``allowed_resume_roots``."""
    from trainyard.storage import local_path

    roots, problems = [run.checkpoint_root], []
    cold = run.cold_checkpoint_uri
    if cold.startswith("file://"):
        roots.append(Path(local_path(cold)))
    for (name, uri), text in zip(resume_root_fields(run.spec), run.spec.training.allowed_resume_roots):
        path = Path(local_path(run.resolve(name, uri)))  # checked again rendered: ${VAR} may hold anything
        if not path.is_absolute() or ".." in path.parts:
            problems.append(f"{name}: {text!r} must be an absolute folder path without '..'")
        else:
            roots.append(path)
    return roots, problems


def check_resume(run: Run) -> None:
    """``SpecError`` (naming the spec file) unless the run's ``resume_from`` is inside its allowed roots."""
    roots, problems = resume_roots(run)
    problems += resume_problems(run.spec, run.spec.training.resume_from, roots)
    if problems:
        raise SpecError([f"{run.spec_path}: {p}" for p in problems])

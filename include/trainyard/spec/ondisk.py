"""What a valid spec names must exist where it runs: variables set, the dataset's ``file://`` source, the entrypoint.

These are facts about a machine, not about the file, so only ``trainyard check``
asks them (``spec.review``); the DAG folder's scan does not (no I/O at parse
time beyond the spec files). Each answer is an error or a warning:

- an allowed ``${VAR}`` that is not set is an error: rendering it fails the run
  (``templating.render``). ``TRAINYARD_HOME`` has a default and is never unset.
- a plain ``file://`` source, or a plain ``.py`` entrypoint or module on the local
  backend, that is missing here is an error: the run would fail at its first task.
- the same path under ``${VAR}`` or ``{{ ds }}``, or an entrypoint on Kubernetes
  (it lives in the image), may exist only on the workers or only on the night it
  is run: a warning, which never changes the exit code.

Run ``trainyard check`` with the workers' environment (CI does) for the errors to mean what they say.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, NamedTuple

from trainyard.spec.messages import dotted
from trainyard.spec.models import PipelineSpec
from trainyard.spec.templating import ENV_REF, HOME_VARIABLE, TEMPLATE, allowed_variables, render


class Findings(NamedTuple):
    """``field: message`` lines: errors refuse the spec, warnings only inform."""

    errors: list[str]
    warnings: list[str]


def ondisk_findings(spec: PipelineSpec, environ: Mapping[str, str] | None = None) -> Findings:
    env = os.environ if environ is None else environ
    found = Findings(unset_variables(spec, env), [])
    _source(spec, env, found)
    _entrypoint(spec, env, found)
    return found


def unset_variables(spec: PipelineSpec, env: Mapping[str, str]) -> list[str]:
    """An error per field that names an allowed ``${VAR}`` without a value here (a refused one is told already)."""
    allowed = allowed_variables(env)
    problems = []
    for loc, text in _strings(spec.model_dump(mode="json", exclude_defaults=True)):
        for name in dict.fromkeys(ENV_REF.findall(text)):
            if name in allowed and name != HOME_VARIABLE and not env.get(name):
                problems.append(
                    f"{dotted(loc)}: ${{{name}}} is not set here, so the run would fail to fill it in; set {name}"
                    " where Airflow's workers run (and where you run trainyard check), or drop it"
                )
    return problems


def _strings(node: Any, loc: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    if isinstance(node, str):
        yield loc, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, (*loc, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, (*loc, i))


def _varies(text: str) -> bool:
    return bool(ENV_REF.search(text) or TEMPLATE.search(text))


def _here(text: str, env: Mapping[str, str]) -> Path | None:
    """``text`` with its ``${VAR}`` filled in and cut before its first ``{{ }}`` template (the part fixed for
    every run); None where a variable cannot be filled in (told by ``unset_variables``)."""
    fixed = text.split("{{", 1)[0]
    fixed = fixed.rsplit("/", 1)[0] if "{{" in text else fixed
    try:
        return Path(render(fixed, {}, env))
    except KeyError:
        return None


def _source(spec: PipelineSpec, env: Mapping[str, str], found: Findings) -> None:
    uri = spec.dataset.source
    if not uri.startswith("file://"):
        return  # an s3:// source is checked when staging, with the connection's credentials
    path = _here(uri.removeprefix("file://"), env)
    if path is None or path.exists():
        return
    if _varies(uri):
        found.warnings.append(
            f"dataset.source: {str(path)!r} (from {uri!r}) does not exist on this machine; fine if it exists on"
            " Airflow's workers (or is written before the run), else the run fails at stage_dataset"
        )
    else:
        found.errors.append(
            f"dataset.source: {str(path)!r} does not exist; the run would fail at stage_dataset: create it"
            " (trainyard demo-data writes a synthetic one) or fix the path"
        )


def _entrypoint(spec: PipelineSpec, env: Mapping[str, str], found: Findings) -> None:
    training, local = spec.training, spec.nodes.backend == "local"
    entry = training.entrypoint
    if entry.endswith(".py"):
        path = _here(entry, env) if "{{" not in entry else None
        missing = path is not None and path.is_absolute() and not path.is_file()
        what = f"the script {str(path)!r}"
    else:
        workdir = _here(training.workdir, env) if training.workdir and "{{" not in training.workdir else None
        missing = not module_found(entry, [str(workdir)] if workdir else [])
        what = f"the module {entry!r} (searched {'training.workdir and ' if workdir else ''}{sys.executable}'s path)"
    if not missing:
        return
    if local and not _varies(entry) and not _varies(training.workdir or ""):
        found.errors.append(f"training.entrypoint: {what} does not exist; the run would fail at train: fix it")
    else:
        where = "the image" if not local else "Airflow's workers"
        found.warnings.append(f"training.entrypoint: {what} is not on this machine; make sure {where} has it")


def module_found(name: str, first: list[str]) -> bool:
    """Whether ``python -m name`` finds a module, looked up without importing (running) any of it."""
    parts = name.split(".")
    search = [*first, *sys.path]
    for i in range(len(parts)):
        found = PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if found is None:
            return False
        search = list(found.submodule_search_locations or [])
        if not search and i < len(parts) - 1:
            return False  # a module, not a package, cannot hold the rest of the name
    return True

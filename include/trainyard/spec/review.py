"""``trainyard check``'s findings: each file's errors and warnings, its folder's specs checked together.

``check_files`` gives the rules of the spec and of a DAG folder (what would break
Airflow's parse or a run, whatever the machine); ``review`` adds what must exist
on this machine (``spec.ondisk``) and sorts every line under its file, so one
bad file never stops the others being checked and all are reported at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.errors import SpecError
from trainyard.spec.folders import nested_specs
from trainyard.spec.ids import dag_id_problems, duplicate_ids
from trainyard.spec.load import load_spec, spec_files
from trainyard.spec.models import PipelineSpec
from trainyard.spec.ondisk import ondisk_findings

# A line's leading field path (``nodes.kubernetes.namespace``, ``notify.email[1]``, ``(top level)``).
_FIELD = re.compile(r"(\(top level\)|[A-Za-z_][\w-]*(\.[\w-]+|\[\d+\])*): ")


@dataclass(frozen=True)
class Finding:
    field: str
    """The dotted field path it is about; empty for the file as a whole (unreadable, invalid YAML)."""
    message: str


@dataclass
class FileReport:
    file: Path
    errors: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def finding(line: str, file: Path | None = None) -> Finding:
    """A ``[FILE: ]field.path: message`` line as a ``Finding``."""
    if file is not None:
        line = line.removeprefix(f"{file}: ")
    match = _FIELD.match(line)
    return Finding(match.group(1), line[match.end() :]) if match else Finding("", line)


def check_files(paths: Iterable[str | Path]) -> list[str]:
    """Every problem in every file (or folder of files), one ``FILE: field: message`` line each; empty when all
    are valid. Besides each file's own problems, the valid specs are checked together, as the DAG folder reads
    them: each needs a DAG id Airflow accepts, of its own (``ids``), and no dataset folder may nest in another's
    (``folders.nested_specs``)."""
    return [f"{r.file}: {f.field}: {f.message}" if f.field else f"{r.file}: {f.message}" for r in _rules(paths)[0]
            for f in r.errors]  # fmt: skip


def review(paths: Iterable[str | Path], environ: Mapping[str, str] | None = None) -> list[FileReport]:
    """A report per file (and per folder without specs): ``check_files``' rules, then what must exist here."""
    reports, valid = _rules(paths)
    for report in reports:
        if (spec := valid.get(report.file)) is not None:
            errors, warnings = ondisk_findings(spec, environ)
            report.errors += map(finding, errors)
            report.warnings += map(finding, warnings)
    return reports


def _rules(paths: Iterable[str | Path]) -> tuple[list[FileReport], dict[Path, PipelineSpec]]:
    folders = [Path(p) for p in paths]
    reports: dict[Path, FileReport] = {}
    for folder in folders:
        if folder.is_dir() and not spec_files([folder]):
            msg = "no spec files (*.yaml, *.yml) in this folder; name a folder of specs or a file"
            reports[folder] = FileReport(folder, [Finding("", msg)])
    valid: dict[Path, PipelineSpec] = {}
    for path in dict.fromkeys(spec_files(folders)):  # a file named twice is checked once
        report = reports.setdefault(path, FileReport(path))
        try:
            valid[path] = load_spec(path)
        except SpecError as exc:
            report.errors += (finding(line, path) for line in exc.problems)
    for path in dict.fromkeys(spec_files(folders)):
        reports[path].errors += map(finding, dag_id_problems(path, valid.get(path)))
    for path, line in duplicate_ids(valid).items():
        reports[path].errors.append(finding(line))
    for path, line in nested_specs(valid).items():
        reports[path].errors.append(finding(line, path))
    return list(reports.values()), valid

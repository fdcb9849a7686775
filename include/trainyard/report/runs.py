"""The run folders under ``$TRAINYARD_HOME/runs``: find one safely, list them all.

Ids come from URLs, so they are checked before they touch the file system:
a DAG or run id is mapped to its folder with ``ledger.safe_name`` (as the
stages name folders), and anything that could step outside the runs root is
refused with ``RunNotFound`` rather than normalised into some other path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainyard.ledger import LEDGER_FILE, Ledger, safe_name
from trainyard.report.summary import run_identity, summarize
from trainyard.templating import render

OVERVIEW = ("state", "started", "ended", "attempts", "steps_trained", "last_loss")


class RunNotFound(LookupError):
    """No such run, or an id that is not one; the message says which, for a 404."""


def runs_root() -> Path:
    """Where the stages keep run folders by default (the spec's ``runs_root``)."""
    return Path(render("${TRAINYARD_HOME}/runs", {}))


def check_id(kind: str, value: str) -> None:
    """Refuse ids that are path syntax rather than names ('..', separators, NUL)."""
    if not value or value in (".", "..") or ".." in value or any(c in value for c in "/\\\0"):
        raise RunNotFound(f"{value!r} is not a valid {kind} id (no '..', '/' or '\\' allowed)")


def find_run(root: Path, dag_id: str, run_id: str) -> Path:
    """The folder of run ``run_id`` of ``dag_id`` (the Airflow id or its folder name), inside ``root``."""
    check_id("DAG", dag_id)
    check_id("run", run_id)
    base = root.resolve()
    folder = (root / safe_name(dag_id) / safe_name(run_id)).resolve()
    if not folder.is_relative_to(base):  # a symlinked folder pointing elsewhere
        raise RunNotFound(f"run {run_id!r} of DAG {dag_id!r} is outside the runs folder")
    if not (folder / LEDGER_FILE).is_file():
        raise RunNotFound(f"no run {run_id!r} of DAG {dag_id!r}: no ledger at"
                          f" runs/{safe_name(dag_id)}/{safe_name(run_id)}/{LEDGER_FILE}")
    return folder


def run_folders(root: Path) -> list[Path]:
    """Every folder under ``root/<dag>/`` that holds a ledger."""
    if not root.is_dir():
        return []
    return sorted(ledger.parent for dag in root.iterdir() if dag.is_dir()
                  for ledger in dag.glob(f"*/{LEDGER_FILE}") if ledger.is_file())


def overview(folder: Path) -> dict[str, Any]:
    """One index row: who the run is and how it went."""
    summary = summarize(Ledger.in_dir(folder))
    return {**run_identity(folder), "folder": folder.name, **{k: summary[k] for k in OVERVIEW},
            "has_report": (folder / "report.html").is_file()}

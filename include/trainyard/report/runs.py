"""The run folders under ``$TRAINYARD_HOME/runs``: find one safely, list them all.

Ids come from URLs, so they are checked before they touch the file system:
a DAG or run id is mapped to its folder with ``ledger.safe_name`` (as the
stages name folders), and anything that could step outside the runs root is
refused with ``RunNotFound`` rather than normalised into some other path.

A folder is served as run ``run_id`` of DAG ``dag_id`` only if it belongs to
them: the ids its ``spec.json`` (written when the run starts) records are
those ids; a folder without one counts only under the DAG's own folder name,
which no other DAG id maps to. Folders named the way trainyard named them
before names were made distinct (``ledger.legacy_name``) are still found, with
the same check, so another DAG's run is never shown under a DAG the caller
may read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainyard.atomic import UnsafePath, open_regular, read_json
from trainyard.events.ledger import LEDGER_FILE, Ledger, legacy_name, safe_name
from trainyard.report.summary import run_identity, summarize
from trainyard.spec.templating import render

OVERVIEW = ("state", "started", "ended", "attempts", "steps_trained", "last_loss")
SNAPSHOT = "spec.json"  # trainyard.pipeline.run.SNAPSHOT: the run module imports what the report imports


class RunNotFound(LookupError):
    """No such run, or an id that is not one; the message says which, for a 404."""


def runs_root() -> Path:
    """Where the stages keep run folders by default (the spec's ``runs_root``)."""
    return Path(render("${TRAINYARD_HOME}/runs", {}))


def check_id(kind: str, value: str) -> None:
    """Refuse ids that are path syntax rather than names ('..', separators, NUL)."""
    if not value or value in (".", "..") or ".." in value or any(c in value for c in "/\\\0"):
        raise RunNotFound(f"{value!r} is not a valid {kind} id (no '..', '/' or '\\' allowed)")


def _names(value: str) -> list[str]:
    """Folder names an id may have: today's, the one before names were distinct, the folder name itself."""
    return list(dict.fromkeys((safe_name(value), legacy_name(value), value)))


def recorded_ids(folder: Path) -> tuple[str, str] | None:
    """The (DAG id, run id) a run folder's snapshot records; None without a snapshot.

    Read without following links; a snapshot that cannot be read (a link, not
    JSON, no ids) is ``RunNotFound``: nobody can tell whose run this is.
    """
    try:
        snap = read_json(folder / SNAPSHOT)
        return str(snap["dag_id"]), str(snap["run_id"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc) if isinstance(exc, UnsafePath) else f"{type(exc).__name__}: {exc}"
        raise RunNotFound(
            f"run folder {folder.parent.name}/{folder.name}: its {SNAPSHOT} cannot tell whose run it is ({reason})"
        ) from None


def belongs(folder: Path, dag_id: str, run_id: str) -> bool:
    """Whether ``folder`` is the folder of ``run_id`` of ``dag_id`` (see the module docstring)."""
    recorded = recorded_ids(folder)
    if recorded is None:
        return folder.parent.name == safe_name(dag_id)
    return recorded == (dag_id, run_id)


def servable(path: Path) -> bool:
    """Whether the view may show ``path``: a regular file with no other name (not a link to one elsewhere)."""
    try:
        with open_regular(path, single_link=True):
            return True
    except OSError:  # missing, or a link planted in its place
        return False


def find_run(root: Path, dag_id: str, run_id: str) -> Path:
    """The folder of run ``run_id`` of ``dag_id`` inside ``root`` (a folder name as run id works for a run
    without a snapshot)."""
    check_id("DAG", dag_id)
    check_id("run", run_id)
    base = root.resolve()
    for dag_name in _names(dag_id):
        for run_name in _names(run_id):
            folder = (root / dag_name / run_name).resolve()
            if not folder.is_relative_to(base):  # a symlinked folder pointing elsewhere
                raise RunNotFound(f"run {run_id!r} of DAG {dag_id!r} is outside the runs folder")
            if servable(folder / LEDGER_FILE) and belongs(folder, dag_id, run_id):
                return folder
    raise RunNotFound(
        f"no run {run_id!r} of DAG {dag_id!r}: no ledger at runs/{safe_name(dag_id)}/{safe_name(run_id)}/{LEDGER_FILE}"
    )


def run_folders(root: Path) -> list[Path]:
    """Every folder under ``root/<dag>/`` that holds a ledger (a regular file, not a link to one)."""
    if not root.is_dir():
        return []
    return sorted(
        ledger.parent
        for dag in root.iterdir()
        if dag.is_dir()
        for ledger in dag.glob(f"*/{LEDGER_FILE}")
        if ledger.is_file() and not ledger.is_symlink()
    )


def overview(folder: Path) -> dict[str, Any]:
    """One index row: who the run is and how it went; ``owned`` is False for a folder that does not
    belong to the ids it names (the index leaves it out)."""
    summary = summarize(Ledger.in_dir(folder))
    identity = run_identity(folder)
    try:
        owned = belongs(folder, identity["dag_id"], identity["run_id"])
    except RunNotFound:
        owned = False
    return {
        **identity,
        "folder": folder.name,
        **{k: summary[k] for k in OVERVIEW},
        "has_report": servable(folder / "report.html"),
        "owned": owned,
    }

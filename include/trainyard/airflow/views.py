"""The training-runs view: a FastAPI app the Airflow API server mounts (see ``plugins/trainyard_views.py``).

Routes only: finding runs is ``trainyard.report.runs``, the HTML is
``trainyard.report.pages``; both read the run ledger alone. Airflow does not
guard a plugin's app, so every route asks the caller's identity the way
Airflow's own API does (a bearer token, or the UI's session cookie, which the
UI's iframe sends) and the right to read that DAG's runs. Airflow's security
module is imported on first request, not at import: every task process loads
plugins, and none of them serves this app.

A run folder is written by training code too (untrusted, docs/architecture.md, rule 11): the
view serves a file only if it is a regular file of that folder, never a link
(``trainyard.atomic.open_regular``), and only from a folder that belongs to the
DAG id in the URL (``trainyard.report.runs.belongs``). The report file holds
strings training code chose, so it is sent sandboxed (no script, no origin);
every response carries ``nosniff`` and a policy that runs no script.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainyard.atomic import open_regular
from trainyard.events.ledger import Ledger
from trainyard.report import pages
from trainyard.report.details import read_node_log, run_details
from trainyard.report.runs import RunNotFound, check_id, find_run, overview, run_folders, runs_root, servable
from trainyard.report.summary import run_identity, summarize
from trainyard.text import printable

URL_PREFIX = pages.URL_PREFIX
REPORT = "report.html"
NO_SCRIPT = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
"""The view's own pages: inline CSS and SVG only; ledger strings are escaped, and this holds if one is not."""
SANDBOX = f"sandbox; {NO_SCRIPT}"
"""The report file: generated from strings training code controls, shown as an opaque, script-less document."""
log = logging.getLogger(__name__)

MayRead = Callable[[str], Awaitable[bool]]
"""Given a DAG id: may the caller read that DAG's runs?"""


async def access(request: Request) -> MayRead:
    """Authenticate like Airflow's API (401 without credentials); authorize per DAG as ``GET`` on its runs."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user, requires_access_dag

    user = await get_user(request, None, await bearer_scheme(request))

    async def may_read(dag_id: str) -> bool:
        try:  # the check reads the DAG's team from the metadata DB: off the event loop
            await run_in_threadpool(requires_access_dag("GET", DagAccessEntity.RUN, dag_id), request, user)
        except HTTPException:
            return False
        return True

    return may_read


Access = Depends(access)
app = FastAPI(title="trainyard training runs", docs_url=None, redoc_url=None, openapi_url=None)

# The ledger reader parses only appended lines, but summarize() still walks every event; the index
# would do so for every run on each visit. Keyed by the sizes and mtimes of the ledger's files
# (events.jsonl and every writer's), so an appended event invalidates the row (or the run page's summary).
_overviews: dict[Path, tuple[Hashable, dict[str, Any]]] = {}
_summaries: dict[Path, tuple[Hashable, dict[str, Any]]] = {}
SUMMARIES_KEPT = 16  # run pages: a summary holds a chart's curve and every checkpoint, so only a few


def _stamp(folder: Path) -> Hashable:
    return Ledger.in_dir(folder).stamp()  # lstat only: a link is refused when the ledger is read


def _overview(folder: Path) -> dict[str, Any]:
    key = _stamp(folder)
    cached = _overviews.get(folder)
    if cached is None or cached[0] != key:
        cached = _overviews[folder] = (key, overview(folder))
    return cached[1]


def _summary(folder: Path) -> dict[str, Any]:
    key = _stamp(folder)
    cached = _summaries.pop(folder, None)
    if cached is None or cached[0] != key:
        identity = run_identity(folder)
        # Airflow's pages from the run page (runs/<dag>/<run> under the view's prefix): up to the UI's root.
        details = run_details(folder, identity["dag_id"], identity["run_id"], "../../..")
        cached = (key, {**summarize(Ledger.in_dir(folder)), "details": details})
    _summaries[folder] = cached  # most recently viewed last
    while len(_summaries) > SUMMARIES_KEPT:
        _summaries.pop(next(iter(_summaries)))
    return cached[1]


@app.middleware("http")
async def _headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """No response is sniffed into another type, and none runs script (the report also gets a sandbox)."""
    response = await call_next(request)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers.setdefault("Content-Security-Policy", NO_SCRIPT)
    return response


@app.exception_handler(StarletteHTTPException)
async def _not_routed(request: Request, exc: StarletteHTTPException) -> Response:
    """Say what went wrong in words; a '..' or '/' inside an id lands here when it splits the path."""
    if exc.status_code != 404:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    return JSONResponse(
        {"detail": f"no such page in the training-runs view: {request.url.path} (a run is at runs/<dag_id>/<run_id>)"},
        status_code=404,
    )


async def _run(dag_id: str, run_id: str, may_read: MayRead) -> Path:
    check_id("DAG", dag_id)  # a malformed id is a 404 before any check that could touch the DB
    check_id("run", run_id)
    if not await may_read(dag_id):
        raise PermissionError(f"you may not read the runs of DAG {dag_id!r}")
    return find_run(runs_root(), dag_id, run_id)  # read per request, as the stages read it


def _error(exc: Exception, as_json: bool, home: str = "../../") -> Response:
    status = 403 if isinstance(exc, PermissionError) else 404
    if as_json:
        return JSONResponse({"detail": str(exc)}, status_code=status)
    return HTMLResponse(pages.error_page(status, str(exc), home), status_code=status)


def _rows() -> list[dict[str, Any]]:
    """Index rows of the runs whose folders belong to the ids they name; one unreadable run costs its row only."""
    rows = []
    for folder in run_folders(runs_root()):
        try:
            row = _overview(folder)
        except OSError as exc:  # a ledger replaced by a link or removed since the listing
            log.warning(
                "training-runs index: run folder %s left out: %s", printable(folder, 4096), printable(exc, 4096)
            )
            continue
        if row["owned"]:
            rows.append(row)
    return rows


async def _readable(may_read: MayRead) -> list[dict[str, Any]]:
    """Index rows of every run whose DAG the caller may read."""
    rows = await run_in_threadpool(_rows)
    allowed = {dag: await may_read(dag) for dag in {r["dag_id"] for r in rows}}
    return [r for r in rows if allowed[r["dag_id"]]]


@app.get("/", response_class=HTMLResponse)
async def index(may_read: MayRead = Access) -> Response:
    return HTMLResponse(pages.index_page(await _readable(may_read), str(runs_root())))


@app.get("/api/runs")
async def list_runs(may_read: MayRead = Access) -> Response:
    return Response(pages.to_json(await _readable(may_read)), media_type="application/json")


@app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse)
async def run_view(dag_id: str, run_id: str, may_read: MayRead = Access) -> Response:
    try:
        folder = await _run(dag_id, run_id, may_read)
        summary = await run_in_threadpool(_summary, folder)
    except (RunNotFound, PermissionError, OSError) as exc:
        return _error(exc, as_json=False)
    return HTMLResponse(pages.run_page(summary, run_identity(folder), servable(folder / REPORT)))


@app.get("/runs/{dag_id}/{run_id}/summary.json")
async def run_json(dag_id: str, run_id: str, may_read: MayRead = Access) -> Response:
    try:
        folder = await _run(dag_id, run_id, may_read)
        summary = await run_in_threadpool(_summary, folder)
    except (RunNotFound, PermissionError, OSError) as exc:
        return _error(exc, as_json=True)
    return Response(pages.to_json({**run_identity(folder), **summary}), media_type="application/json")


@app.get("/runs/{dag_id}/{run_id}/{folder}/{name}")
async def node_log(dag_id: str, run_id: str, folder: str, name: str, may_read: MayRead = Access) -> Response:
    """A node log of the run (``burn-in/node-0.log``, ``attempt-2/node-1.log``), as plain text: its end, read by
    descriptors from the run folder down (``details.read_node_log``: no link followed, no other name served)."""
    try:
        run = await _run(dag_id, run_id, may_read)
        body = await run_in_threadpool(read_node_log, run, f"{folder}/{name}")
    except (RunNotFound, PermissionError) as exc:  # PermissionError first: it is an OSError too
        return _error(exc, as_json=False, home="../../../../")
    except OSError as exc:  # missing, a link, not a file: the message says which, no path outside the run
        return _error(RunNotFound(f"no node log {folder}/{name}: {exc}"), as_json=False, home="../../../../")
    return PlainTextResponse(body.decode("utf-8", "replace"), headers={"Content-Security-Policy": SANDBOX})


@app.get("/runs/{dag_id}/{run_id}/report.html")
async def run_report(dag_id: str, run_id: str, may_read: MayRead = Access) -> Response:
    try:
        folder = await _run(dag_id, run_id, may_read)
        body = await run_in_threadpool(_report, folder, dag_id, run_id)
    except (RunNotFound, PermissionError) as exc:
        return _error(exc, as_json=False, home="../../../")
    return Response(body, media_type="text/html", headers={"Content-Security-Policy": SANDBOX})


def _report(folder: Path, dag_id: str, run_id: str) -> bytes:
    """The report file's bytes, read from the descriptor that was checked: a regular file with one name."""
    try:
        with open_regular(folder / REPORT, single_link=True) as fh:
            return fh.read()
    except FileNotFoundError:
        raise RunNotFound(f"run {run_id!r} of DAG {dag_id!r} has no report yet (the report task writes it)") from None
    except OSError as exc:
        raise RunNotFound(f"run {run_id!r} of DAG {dag_id!r}: its report cannot be served ({exc})") from None

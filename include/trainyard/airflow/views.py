"""The training-runs view: a FastAPI app the Airflow API server mounts (see ``plugins/trainyard_views.py``).

Routes only: finding runs is ``trainyard.report.runs``, the HTML is
``trainyard.report.pages``; both read the run ledger alone. Airflow does not
guard a plugin's app, so every route asks the caller's identity the way
Airflow's own API does (a bearer token, or the UI's session cookie, which the
UI's iframe sends) and the right to read that DAG's runs. Airflow's security
module is imported on first request, not at import: every task process loads
plugins, and none of them serves this app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainyard.ledger import Ledger
from trainyard.report import pages
from trainyard.report.runs import RunNotFound, check_id, find_run, overview, run_folders, runs_root
from trainyard.report.summary import run_identity, summarize

URL_PREFIX = pages.URL_PREFIX

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
# would do so for every run on each visit. Keyed by the ledger's size and mtime, so an appended
# event invalidates the row (or the run page's summary).
_overviews: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}
_summaries: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}
SUMMARIES_KEPT = 16  # run pages: a summary holds a chart's curve and every checkpoint, so only a few


def _stamp(folder: Path) -> tuple[int, int]:
    stat = (folder / "events.jsonl").stat()
    return stat.st_size, stat.st_mtime_ns


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
        cached = (key, summarize(Ledger.in_dir(folder)))
    _summaries[folder] = cached  # most recently viewed last
    while len(_summaries) > SUMMARIES_KEPT:
        _summaries.pop(next(iter(_summaries)))
    return cached[1]


@app.exception_handler(StarletteHTTPException)
async def _not_routed(request: Request, exc: StarletteHTTPException) -> Response:
    """Say what went wrong in words; a '..' or '/' inside an id lands here when it splits the path."""
    if exc.status_code != 404:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    return JSONResponse({"detail": f"no such page in the training-runs view: {request.url.path}"
                                   " (a run is at runs/<dag_id>/<run_id>)"}, status_code=404)


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


async def _readable(may_read: MayRead) -> list[dict[str, Any]]:
    """Index rows of every run whose DAG the caller may read."""
    rows = await run_in_threadpool(lambda: [_overview(f) for f in run_folders(runs_root())])
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
    except (RunNotFound, PermissionError) as exc:
        return _error(exc, as_json=False)
    summary = await run_in_threadpool(_summary, folder)
    return HTMLResponse(pages.run_page(summary, run_identity(folder), (folder / "report.html").is_file()))


@app.get("/runs/{dag_id}/{run_id}/summary.json")
async def run_json(dag_id: str, run_id: str, may_read: MayRead = Access) -> Response:
    try:
        folder = await _run(dag_id, run_id, may_read)
    except (RunNotFound, PermissionError) as exc:
        return _error(exc, as_json=True)
    summary = await run_in_threadpool(_summary, folder)
    return Response(pages.to_json({**run_identity(folder), **summary}), media_type="application/json")


@app.get("/runs/{dag_id}/{run_id}/report.html")
async def run_report(dag_id: str, run_id: str, may_read: MayRead = Access) -> Response:
    try:
        folder = await _run(dag_id, run_id, may_read)
        if not (folder / "report.html").is_file():
            raise RunNotFound(f"run {run_id!r} of DAG {dag_id!r} has no report yet (the report task writes it)")
    except (RunNotFound, PermissionError) as exc:
        return _error(exc, as_json=False, home="../../../")
    return FileResponse(folder / "report.html", media_type="text/html")

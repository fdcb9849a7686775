"""What a run's pages show beside its ledger: the pinned spec, the data check's and the gate's
great-expectations results, the node logs, and the links to the run in Airflow.

A run folder is written by training code too (rule 11): every file is read by descriptor, one held folder
at a time, never through a link, each size-capped (``trainyard.held``, ``atomic.read_capped``); a file that
cannot be read so is left out with the reason, never a crash of the report or the view. Node logs are only
listed here (name and size); the view serves one by ``read_node_log``, whose name must match ``NODE_LOG``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from trainyard import held
from trainyard.atomic import loads_untrusted, read_capped

SNAPSHOT = "spec.json"  # trainyard.pipeline.run.SNAPSHOT (the run module imports the report)
DATA_RESULT = "data_quality.json"  # trainyard.quality.dataset.RESULT_FILE (kept out: it imports GX's pandas)
GATE_RESULT = "metric_quality.json"  # trainyard.quality.metrics.RESULT_FILE
MAX_JSON = 8 << 20
"""The largest result or snapshot file read (GX keeps at most a few offending rows per expectation)."""
LOG_FOLDERS = re.compile(r"(burn-in|attempt-[0-9]{1,6})")
NODE_LOG = re.compile(r"(burn-in|attempt-[0-9]{1,6})/([A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.log)")
"""A node log's name inside its run folder: a burn-in's or an attempt's folder, then the node's log file."""
MAX_LOG = 4 << 20
"""The most of a node log served: its end, where the error is."""
LOGS_KEPT = 200
"""The most node logs listed (a run of many relaunches keeps every attempt's)."""
STAGES = ("stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report")
"""The pipeline's stages (its Airflow tasks), in order: the one list the summary, pages and links use."""


def _json(run_dir: Path, name: str) -> tuple[Any, str | None]:
    """(content, None), or (None, why it cannot be shown); (None, None) when the file is not there."""
    try:
        return loads_untrusted(read_capped(run_dir / name, MAX_JSON), name), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{name} cannot be shown: {exc}"


def expectations(result: Any) -> list[dict[str, Any]]:
    """Each great-expectations result as ``{suite, check, passed, observed}``; a text dataset's result holds
    one validation per table (``files``, ``documents``)."""
    if not isinstance(result, Mapping):
        return []
    parts = [(None, result)] if "results" in result else [(k, v) for k, v in result.items() if isinstance(v, Mapping)]
    rows = []
    for suite, validation in parts:
        for r in validation.get("results") or []:
            if not isinstance(r, Mapping):
                continue
            config = r.get("expectation_config") or {}
            rows.append(
                {
                    "suite": suite,
                    "check": config.get("description") or config.get("type"),
                    "passed": r.get("success") is True,
                    "observed": _observed(r.get("result") or {}, r.get("exception_info") or {}),
                }
            )
    return rows


def _observed(result: Mapping[str, Any], error: Mapping[str, Any]) -> str:
    """What the check saw: its observed value, else how many rows missed it and a few of them."""
    if error.get("raised_exception"):
        return f"could not run: {error.get('exception_message')}"
    if "observed_value" in result:
        return str(result["observed_value"])
    if "unexpected_count" in result:
        some = result.get("partial_unexpected_list") or []
        text = f"{result['unexpected_count']} of {result.get('element_count', '?')} rows outside"
        return text + (f" (e.g. {', '.join(map(str, some[:5]))})" if some else "")
    return ""


def node_logs(run_dir: Path) -> list[dict[str, Any]]:
    """``{name, bytes}`` of each node log of the run (burn-in and every attempt), links and non-files left out."""
    try:
        root = held.open_root(run_dir)
    except OSError:
        return []
    found: list[dict[str, Any]] = []
    try:
        for folder in sorted(os.listdir(root)):
            if not LOG_FOLDERS.fullmatch(folder):
                continue
            try:
                fd = held.descend(root, [folder])  # a link in the folder's place is refused
            except OSError:
                continue
            try:
                for name in sorted(os.listdir(fd)):
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if NODE_LOG.fullmatch(f"{folder}/{name}") and stat.S_ISREG(info.st_mode):
                        found.append({"name": f"{folder}/{name}", "bytes": info.st_size})
            finally:
                os.close(fd)
    finally:
        os.close(root)
    found.sort(key=lambda log: (_attempt(log["name"]), log["name"]))
    return found[:LOGS_KEPT]


def _attempt(name: str) -> int:
    """Burn-in first, then attempts in number order (attempt-10 after attempt-9)."""
    folder = name.split("/", 1)[0]
    return int(folder.removeprefix("attempt-")) if folder.startswith("attempt-") else 0


def read_node_log(run_dir: Path, name: str) -> bytes:
    """The end (``MAX_LOG``) of node log ``name`` (``burn-in/node-0.log``, ``attempt-2/node-1.log``).

    ``FileNotFoundError`` for a name that is not a node log's (path syntax included: the name must match
    ``NODE_LOG``), and ``UnsafePath`` for a link or a non-file, at any level: read by descriptors from the
    run folder down, never through a link."""
    match = NODE_LOG.fullmatch(name)
    if match is None:
        raise FileNotFoundError(f"{name!r} is not a node log (burn-in/<node>.log or attempt-<n>/<node>.log)")
    root = held.open_root(run_dir)
    try:
        folder = held.descend(root, [match.group(1)])
        try:
            fd = held.open_file(folder, match.group(2))
        finally:
            os.close(folder)
    finally:
        os.close(root)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_LOG:
            fh.seek(size - MAX_LOG)
        return fh.read(MAX_LOG)


def airflow_links(base: str, dag_id: str, run_id: str) -> dict[str, Any]:
    """Airflow's UI pages of the run (``base``: the UI's root, ``[api] base_url`` or a relative path to it):
    the DAG run, and each task instance's page, which shows its log."""
    run = f"{base.rstrip('/')}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"
    return {"dag_run": run, "tasks": {task: f"{run}/tasks/{task}" for task in STAGES}}


def run_details(run_dir: Path, dag_id: str, run_id: str, airflow_base: str) -> dict[str, Any]:
    """The run's details for its pages: ``spec`` (pinned), ``data_checks`` and ``gate_checks`` (GX results),
    ``node_logs``, ``links`` and ``problems`` (files that could not be read, and why)."""
    snapshot, why_spec = _json(run_dir, SNAPSHOT)
    data, why_data = _json(run_dir, DATA_RESULT)
    gate, why_gate = _json(run_dir, GATE_RESULT)
    spec = snapshot.get("spec") if isinstance(snapshot, Mapping) else None
    return {
        "spec": spec if isinstance(spec, Mapping) else None,
        "data_checks": expectations(data),
        "gate_checks": expectations(gate),
        "node_logs": node_logs(run_dir),
        "links": airflow_links(airflow_base, dag_id, run_id),
        "problems": [why for why in (why_spec, why_data, why_gate) if why],
    }

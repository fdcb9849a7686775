"""The training-runs view in a real Airflow API server, read by a real headless browser.

The ledger comes from the real stages on a tiny spec (a throttled burn-in
node, a corrupted checkpoint, a killed training node), produced while the API
server starts with the project's plugins folder on a throwaway PostgreSQL
metadata DB with the LocalExecutor, as in production (SQLite where PostgreSQL
is unavailable, with a warning).
"""

from __future__ import annotations

import html
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest
from airflow_helpers import ROOT, STAGES, airflow_env
from waiting import wait_for

from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.protocol.shards import write_synthetic_corpus

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # measures this machine: see pyproject

DAG_ID = "ui_view"
RUN_ID = "manual__2026-11-28T02:00:00.123456+00:00"  # ':' and '+', as Airflow makes them
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/trainyard/runs
nodes: {{count: 2, min: 1, spare: 1}}
pressure_test:
  duration_s: 2
  matmul_size: 96
  membw_mb: 8
  disk_mb: 8
  collective_sizes_kb: [64]
  straggler_ratio: 0.8   # the throttled node runs at 0.4; the others keep 20% of room for noise
  ratio_overrides: {{disk_write_mbps: 0.1, disk_read_mbps: 0.1}}   # a shared disk is noisy; compute decides
  drills: [{{node: node-2, fault: throttle, factor: 0.6}}]
training:
  args: {{seq-len: 32, d-model: 32, n-heads: 2, lr: 0.01}}
  max_steps: 12
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 4
  checkpoint_async: false   # the page's figures below count steps from the checkpoint before the kill
  heartbeat_timeout_s: 20
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
# The relaunch path: the page's attempts table (two attempts, the scale-down) and the boundary where attempt 2
# resumed are what it shows of a relaunch; a regroup in place is read by test_multi_fault_report.py.
recovery: {{max_attempts: 3, backoff_s: 0.2, in_place: false}}
drills: [{{fault: corrupt_checkpoint, step: 4}}, {{fault: kill, node: node-1, step: 10}}]
"""


def chromium() -> str:
    """The browser, installed here if missing (``make browser`` does the same for CI)."""
    found = shutil.which("chromium")
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=900)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True, timeout=900)
        found = shutil.which("chromium")
    if not found:
        pytest.skip("chromium is not installed and `apt-get install chromium` was not possible (needs root on Debian)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_api_server(home: Path, metadata_db: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = airflow_env(
        home,
        **metadata_db,
        AIRFLOW__CORE__EXECUTOR="LocalExecutor",
        AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
        AIRFLOW__CORE__LAZY_LOAD_PLUGINS="False",  # an import error shows at start, not at first request
        AIRFLOW__CORE__AUTH_MANAGER="airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",  # the view's auth check passes as admin
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
    )
    log = (home / "api-server.log").open("wb")
    server = subprocess.Popen(
        ["airflow", "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return server, port


def wait_ready(proc: subprocess.Popen[bytes], base: str, log: Path, timeout_s: float = 90) -> None:
    def healthy() -> bool:
        assert proc.poll() is None, f"api-server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{base}/api/v2/monitor/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(healthy, timeout_s, "the api-server's health", every_s=0.5, context=lambda: log.read_text()[-3000:])


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def produce_run(root: Path, burned_in: Callable[[], object]) -> None:
    """One run of the real stages: burn-in evicts the throttled node, attempt 1 loses node-1, attempt 2 finishes.

    ``burned_in`` is called once the burn-in has measured the nodes: work started
    there overlaps training without making a healthy node look like a straggler.
    """
    write_synthetic_corpus(root / "cold", shards=2, tokens_per_shard=16_384)
    spec = root / f"{DAG_ID}.yaml"
    spec.write_text(SPEC.format(root=root))
    run = open_run(spec, DAG_ID, RUN_ID, "2026-11-28")
    stages.stage_dataset(run)
    stages.check_dataset(run)
    chosen = stages.burn_in(run)
    burned_in()
    trained = stages.train(run, chosen.healthy, spares=chosen.spare)
    checked = stages.check_checkpoint(run, trained.checkpoint, trained.target_step)
    stages.publish(run, checked.checkpoint)
    stages.report(run)


class Tables(HTMLParser):
    """Each ``<table class=...>`` of a page as rows of cell texts, by class."""

    def __init__(self, page: str):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("class") or "", [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def row(self, table: str, first: str) -> list[str]:
        return next(r for r in self.tables[table] if r and r[0] == first)


def raw_get(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` byte for byte: browsers and HTTP clients remove '..' segments before sending."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_the_run_page_shows_the_runs_ledger_in_a_browser(tmp_path: Path, metadata_db: dict[str, str]) -> None:
    browser = chromium()
    starting: list[Future[tuple[subprocess.Popen[bytes], int]]] = []
    with ThreadPoolExecutor(1) as pool:
        try:  # the metadata DB migrates and the API server starts while the nodes train
            produce_run(tmp_path, lambda: starting.append(pool.submit(start_api_server, tmp_path, metadata_db)))
        except BaseException:
            for future in starting:
                if future.exception() is None:
                    stop(future.result()[0])
            raise
        server, port = starting[0].result()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, base, tmp_path / "api-server.log")

        with urllib.request.urlopen(f"{base}/api/v2/plugins", timeout=10) as r:
            plugins = {p["name"]: p for p in json.load(r)["plugins"]}
        assert [a["url_prefix"] for a in plugins["trainyard"]["fastapi_apps"]] == ["/trainyard"]
        views = {v["name"]: v for v in plugins["trainyard"]["external_views"]}
        assert views["Training runs"]["destination"] == "nav" and views["Training runs"]["href"] == "trainyard/"
        assert views["Training run"]["destination"] == "dag_run" and "{RUN_ID}" in views["Training run"]["href"]
        with urllib.request.urlopen(f"{base}/api/v2/plugins/importErrors", timeout=10) as r:
            assert not [e for e in json.load(r)["import_errors"] if "trainyard_views" in e["source"]]

        page = f"{base}/trainyard/runs/{DAG_ID}/{quote(RUN_ID, safe='')}"
        dom = subprocess.run(
            [
                browser,
                "--headless",
                "--disable-gpu",
                "--no-sandbox",
                f"--user-data-dir={tmp_path / 'chromium'}",
                "--dump-dom",
                page,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert f"Training run {RUN_ID}" in dom, dom[:2000]
        tables = Tables(dom)

        assert [r[0] for r in tables.tables["stages"][1:]] == STAGES
        assert all(r[4] == "ok" for r in tables.tables["stages"][1:])
        node_2 = tables.row("verdicts", "node-2")
        assert node_2[-2] == "evicted" and node_2[-1].startswith("straggler: ")
        assert tables.row("verdicts", "node-0")[-2] == "train"
        assert float(tables.row("verdicts", "threshold")[3]) > 0  # matmul_gflops, after the disk columns
        assert 'aria-label="matmul_gflops per node against its threshold"' in dom

        first, second = tables.tables["attempts"][1:]
        assert first[0] == "1" and first[5].startswith("failed") and "kill on node-1 at step 10" in first[6]
        assert first[7].startswith("node_lost (node-1)") and first[8].startswith("scale_down (new_nodes node-0")
        # Resumed at step 9: the in-memory snapshot of the step before the kill, newer than the checkpoint of 8.
        assert second[0] == "2" and second[1].startswith("node-0 world size 1") and second[2] == "9"
        assert second[5].startswith("succeeded")
        assert 'aria-label="training attempts over time"' in dom

        assert 'aria-label="loss versus step"' in dom and 'class="loss"' in dom
        assert 'class="boundary"' in dom  # where attempt 2 resumed

        checkpoints = {r[1]: r for r in tables.tables["checkpoints"][1:]}
        assert checkpoints["step_000004"][3].startswith("invalid") and "quarantined to" in checkpoints["step_000004"][4]
        assert checkpoints["step_000012"][3] == "valid" and checkpoints["step_000012"][4].startswith("LATEST")
        assert "gate passed" in checkpoints["step_000012"][4]

        recovery = dict(tables.tables["recovery"][1:])
        # From the snapshot of step 9, not the checkpoint of 8: at most the step in flight is trained again.
        assert float(recovery["failure detected after (s)"]) < 10 and int(recovery["steps lost"]) <= 1

        with urllib.request.urlopen(f"{base}/trainyard/", timeout=10) as r:
            index = Tables(r.read().decode())
        assert index.row("runs", RUN_ID)[2] == "succeeded"
        with urllib.request.urlopen(f"{page}/summary.json", timeout=10) as r:
            summary = json.load(r)
        assert summary["run_id"] == RUN_ID and summary["attempts"] == 2 and summary["state"] == "succeeded"
        with urllib.request.urlopen(f"{page}/report.html", timeout=10) as r:  # strings training code chose: sandboxed
            assert r.headers["Content-Security-Policy"].startswith("sandbox;") and b"<html" in r.read()
            assert r.headers["X-Content-Type-Options"] == "nosniff"

        for path in (
            f"/trainyard/runs/{DAG_ID}/..",
            "/trainyard/runs/../summary.json",
            f"/trainyard/runs/{DAG_ID}/..%2F..%2F..%2Fetc/summary.json",
            f"/trainyard/runs/{DAG_ID}/nope",
        ):
            status, body = raw_get(port, path)
            assert status == 404, (path, body)
        assert "not a valid run id" in raw_get(port, f"/trainyard/runs/{DAG_ID}/..")[1]
        assert "no run 'nope' of DAG 'ui_view'" in html.unescape(raw_get(port, f"/trainyard/runs/{DAG_ID}/nope")[1])
    finally:
        stop(server)

"""Metrics: which names and values go out, over real StatsD datagrams, and that sending never fails a task.

A UDP socket on 127.0.0.1 plays the StatsD server. Airflow builds its
metrics client from ``[metrics]`` when a task process starts, so the sending
side runs in a subprocess with ``AIRFLOW__METRICS__STATSD_*`` set: once by
hand (the client initialized as the task runner does it), once as a real
``airflow tasks test`` of a pipeline's stage_dataset task.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from airflow.sdk._shared.observability.metrics.validators import stat_name_default_handler, stat_name_otel_handler
from airflow.sdk.exceptions import AirflowFailException

from trainyard.airflow import metrics, tasks
from trainyard.airflow.metrics import emit_recovery, emit_stage, emitted, metric_name, recovery_metrics, stage_metrics
from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.run import open_run

ROOT = Path(__file__).resolve().parents[2]
# The integration tests' Airflow helpers, by the module name their conftest imports them under: one
# migrated SQLite template per test session, shared with them.
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from airflow_helpers import airflow_env  # noqa: E402

DAG = "nightly.v2"  # a dot, as DAG ids may have: StatsD would read it as one more level
SPEC = """\
dataset: {{source: "file://{home}/cold/tiny", name: tiny, hot: "file://{home}/hot"}}
runs_root: "file://{home}/runs"
nodes: {{count: 1}}
training: {{max_steps: 1, global_batch: 1, micro_batch: 1, checkpoint_every: 1}}
"""


class StatsdServer:
    """A UDP socket on 127.0.0.1 that keeps the datagrams it is sent."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def env(self) -> dict[str, str]:
        return {
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(self.port),
            "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
        }

    def received(self, prefix: str = "airflow.trainyard.") -> dict[str, str]:
        """``name -> "value|type"`` of every metric under ``prefix`` sent so far (the sender has finished)."""
        self.sock.settimeout(0.5)
        out: dict[str, str] = {}
        while True:
            try:
                data = self.sock.recv(65535).decode()
            except TimeoutError:
                return out
            for line in data.splitlines():
                name, _, value = line.partition(":")
                if name.startswith(prefix):
                    assert name not in out, f"{name} sent twice"
                    out[name] = value


@pytest.fixture
def statsd() -> Iterator[StatsdServer]:
    # Without the client package Airflow silently falls back to sending nothing: say so instead.
    if importlib.util.find_spec("statsd") is None:
        pytest.fail("the statsd package is missing (Airflow's statsd extra): add statsd to requirements.txt")
    server = StatsdServer()
    yield server
    server.sock.close()


def ledger_of_a_run(path: Path) -> Ledger:
    """A ledger as the stages write it: a burn-in that passed, a data check that failed, a train stage
    with one failure recovered (the figures of the README's drill example)."""
    ledger = Ledger(path)
    ledger.append("burn_in", "stage_start")
    ledger.append("burn_in", "stage_end", seconds=4.25, result={})
    ledger.append("check_dataset", "stage_start")
    ledger.append("check_dataset", "stage_failed", error="DataError", message="shard_0000.tok", seconds=1.5)
    ledger.append("train", "stage_start")
    ledger.append("train", "attempt_start", attempt=1)
    ledger.append("train", "failure_classified", attempt=1, kind="node_lost", detected_at=0)
    ledger.append("train", "attempt_start", attempt=2)
    ledger.append("train", "stage_end", seconds=16.7, result={})
    ledger.append(
        "train",
        "recovery_figures",
        detection_s=0.694,
        resume_delay_s=7.379,
        lost_steps=9,
        productive_s=1.537,
        ettr=0.092,
    )
    return ledger


# ---------------------------------------------------------------- over the wire


SENDER = """
import sys
from airflow.sdk.configuration import conf
from airflow.sdk.observability import stats
from airflow.sdk.observability.metrics import stats_utils

# What the task runner does first in every task process (airflow.sdk.execution_time.task_runner.main).
stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=conf.getboolean("metrics", "legacy_names_on"))

from trainyard.airflow.metrics import emit_recovery, emit_stage
from trainyard.events.ledger import Ledger

ledger = Ledger(sys.argv[1])
for stage in ("burn_in", "check_dataset", "publish"):  # publish never ran: nothing to send
    emit_stage(ledger, stage, sys.argv[2])
emit_recovery(ledger, sys.argv[2])
"""


def test_stage_and_recovery_figures_arrive_as_statsd_datagrams(tmp_path: Path, statsd: StatsdServer) -> None:
    ledger = ledger_of_a_run(tmp_path / "events.jsonl")
    done = subprocess.run(
        [sys.executable, "-c", SENDER, str(ledger.path), DAG],
        env={**os.environ, **statsd.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert statsd.received() == {
        "airflow.trainyard.stage.duration.nightly__v2.burn_in": "4250.000000|ms",
        "airflow.trainyard.stage.succeeded.nightly__v2.burn_in": "1|c",
        "airflow.trainyard.stage.duration.nightly__v2.check_dataset": "1500.000000|ms",
        "airflow.trainyard.stage.failed.nightly__v2.check_dataset": "1|c",
        "airflow.trainyard.recovery.detection.nightly__v2": "694.000000|ms",
        "airflow.trainyard.recovery.resume_delay.nightly__v2": "7379.000000|ms",
        "airflow.trainyard.recovery.productive.nightly__v2": "1537.000000|ms",
        "airflow.trainyard.recovery.lost_steps.nightly__v2": "9|g",
        "airflow.trainyard.recovery.ettr.nightly__v2": "0.092|g",
        "airflow.trainyard.recovery.attempts.nightly__v2": "2|g",
        "airflow.trainyard.recovery.failures.nightly__v2": "1|g",
    }


def test_a_real_task_sends_its_stage_duration(tmp_path: Path, statsd: StatsdServer) -> None:
    """``airflow tasks test`` of a pipeline built by dag_builder: the adapter in tasks.py sends the metrics."""
    home = tmp_path / "home"
    (home / "cold" / "tiny").mkdir(parents=True)
    (home / "cold" / "tiny" / "a.bin").write_bytes(b"abc")
    (tmp_path / "dags" / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", tmp_path / "dags")
    (tmp_path / "dags" / "pipelines" / "tiny.yaml").write_text(SPEC.format(home=home))
    # A migrated metadata DB: a copy of the session's one (what `airflow db migrate` writes), not a migrate of its own.
    env = airflow_env(tmp_path, tmp_path / "dags", **statsd.env(), TRAINYARD_HOME=str(home))
    # `tasks test` runs the task in a run of its own, never pinned by pin_spec: the stage pins it itself.
    done = subprocess.run(
        ["airflow", "tasks", "test", "tiny", "stage_dataset", "2026-11-28"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [events] = (home / "runs" / "tiny").glob("*/events.jsonl")
    [end] = Ledger(events).events("stage_dataset", "stage_end")
    assert statsd.received() == {
        "airflow.trainyard.stage.duration.tiny.stage_dataset": f"{end['seconds'] * 1000:.6f}|ms",
        "airflow.trainyard.stage.succeeded.tiny.stage_dataset": "1|c",
    }


# ---------------------------------------------------------------- what is sent (no client)


class Recorder:
    """Stands in for ``airflow.sdk.observability.stats``."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, str, Any]] = []
        self.fail = fail

    def _record(self, kind: str, name: str, value: Any, **_: Any) -> None:
        if self.fail:
            raise OSError("statsd host unreachable")
        self.sent.append((kind, name, value))

    def timing(self, name: str, value: Any, **kw: Any) -> None:
        self._record("timing", name, value, **kw)

    def gauge(self, name: str, value: Any, **kw: Any) -> None:
        self._record("gauge", name, value, **kw)

    def incr(self, name: str, value: Any = 1, **kw: Any) -> None:
        self._record("incr", name, value, **kw)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(metrics, "stats", rec)
    return rec


def test_names_pass_airflows_checks_even_for_the_longest_dag_id(tmp_path: Path) -> None:
    ledger = ledger_of_a_run(tmp_path / "events.jsonl")
    long_ids = ["a" * 200, "a" * 199 + "x", "weird id/with:chars"]
    names = [
        m.name
        for dag_id in [DAG, *long_ids]
        for m in stage_metrics(ledger, "burn_in", dag_id) + recovery_metrics(ledger, dag_id)
    ]
    for name in names:
        assert stat_name_default_handler(name) == name  # StatsD (raises when invalid)
        stat_name_otel_handler("airflow", name)  # OpenTelemetry: prefix + name within 255
        assert len(name.split(".")) == (5 if name.startswith("trainyard.stage.") else 4), (
            name
        )  # the DAG id is one level
    assert len(set(names)) == len(names)  # ids cut to fit stay apart
    assert metric_name("stage", "duration", "weird_id_with_chars", "burn_in") in names


def test_only_this_tries_events_count(tmp_path: Path) -> None:
    ledger = ledger_of_a_run(tmp_path / "events.jsonl")
    assert stage_metrics(ledger, "burn_in", DAG, since=time.time() + 1) == []
    ledger.append("burn_in", "stage_failed", error="NodeUnhealthy", message="", seconds=2.0)  # a retry, failed
    assert [(m.kind, m.name, m.value) for m in stage_metrics(ledger, "burn_in", DAG)] == [
        ("timing", "trainyard.stage.duration.nightly__v2.burn_in", 2000.0),
        ("incr", "trainyard.stage.failed.nightly__v2.burn_in", 1),
    ]
    assert stage_metrics(ledger, "publish", DAG) == []


def test_a_failed_train_stage_still_reports_its_recovery(tmp_path: Path) -> None:
    # No recovery_figures event (the policy gave up): the figures are computed from the ledger.
    ledger = Ledger(tmp_path / "events.jsonl")
    ledger.append("train", "attempt_start", attempt=1)
    ledger.append("train", "step", step=1, step_ms=500)
    ledger.append("train", "failure_classified", attempt=1, kind="user_error", detected_at=time.time())
    ledger.append("train", "stage_failed", error="TrainingFailed", message="", seconds=2.0)
    sent = {m.name.rsplit(".", 1)[0]: m.value for m in recovery_metrics(ledger, DAG)}
    assert sent == {
        "trainyard.recovery.detection": pytest.approx(0, abs=50),
        "trainyard.recovery.productive": 500.0,
        "trainyard.recovery.lost_steps": 0,
        "trainyard.recovery.ettr": 0.25,
        "trainyard.recovery.attempts": 1,
        "trainyard.recovery.failures": 1,
    }  # no resume: no resume delay


def test_a_run_without_failures_sends_no_detection_time(tmp_path: Path, recorder: Recorder) -> None:
    ledger = Ledger(tmp_path / "events.jsonl")
    ledger.append(
        "train", "recovery_figures", detection_s=None, resume_delay_s=None, lost_steps=0, productive_s=3.0, ettr=0.9
    )
    emit_recovery(ledger, DAG)
    assert {name.split(".")[2] for _, name, _ in recorder.sent} == {
        "productive",
        "lost_steps",
        "ettr",
        "attempts",
        "failures",
    }


def test_a_broken_client_or_ledger_never_fails_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(metrics, "stats", Recorder(fail=True))
    ledger = ledger_of_a_run(tmp_path / "events.jsonl")
    assert emit_stage(ledger, "burn_in", DAG) == [] and emit_recovery(ledger, DAG) == []
    assert "trainyard metrics for stage burn_in not sent" in caplog.text
    with ledger.path.open("a") as fh:  # not a number: the schema refuses to write it, so the line is planted
        fh.write(json.dumps({"ts": time.time(), "stage": "publish", "event": "stage_end", "seconds": "soon"}) + "\n")
    assert emit_stage(ledger, "publish", DAG) == []


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "tiny.yaml"
    path.write_text(SPEC.format(home=tmp_path))
    opened = open_run(path, DAG, "manual__1", "2026-11-28")
    monkeypatch.setattr(tasks, "open_pinned", lambda spec_path, run_file: opened)
    return opened


def test_an_adapter_sends_the_stage_it_ran_once_even_when_it_fails(run: Any, recorder: Recorder) -> None:
    @recorded("check_dataset")
    def bad_data(run: Any) -> dict[str, Any]:
        raise DataError("shard_0000.tok: truncated header")

    with pytest.raises(AirflowFailException, match="DataError: shard_0000.tok"):  # still mapped to fail-fast
        with tasks.stage_run("unused.yaml", None, "check_dataset") as opened:
            bad_data(opened)
    with pytest.raises(AirflowFailException):  # a second try sends its own figures, not the first one's again
        with tasks.stage_run("unused.yaml", None, "check_dataset") as opened:
            raise DataError("before the stage started")
    assert [(kind, name) for kind, name, _ in recorder.sent] == [
        ("timing", "trainyard.stage.duration.nightly__v2.check_dataset"),
        ("incr", "trainyard.stage.failed.nightly__v2.check_dataset"),
    ]


def test_train_sends_its_recovery_figures_and_a_deferral_sends_nothing(run: Any, recorder: Recorder) -> None:
    with emitted(run, "train"):
        run.ledger.append("train", "stage_start")  # launched, then deferred: the stage has not ended
    assert recorder.sent == []
    with emitted(run, "train"):
        run.ledger.append("train", "attempt_start", attempt=1)
        run.ledger.append("train", "stage_end", seconds=3.0, result={})
        run.ledger.append(
            "train", "recovery_figures", detection_s=None, resume_delay_s=None, lost_steps=0, productive_s=2.4, ettr=0.8
        )
    assert [name for _, name, _ in recorder.sent] == [
        "trainyard.stage.duration.nightly__v2.train",
        "trainyard.stage.succeeded.nightly__v2.train",
        "trainyard.recovery.productive.nightly__v2",
        "trainyard.recovery.lost_steps.nightly__v2",
        "trainyard.recovery.ettr.nightly__v2",
        "trainyard.recovery.attempts.nightly__v2",
        "trainyard.recovery.failures.nightly__v2",
    ]


def test_every_metric_is_documented() -> None:
    page = (ROOT / "docs" / "operating.md").read_text()
    section = page.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    kinds = {
        "stage": ["duration", "succeeded", "failed"],
        "recovery": [n for n, _ in metrics.RECOVERY.values()] + ["attempts", "failures"],
    }
    for group, names in kinds.items():
        for name in names:
            assert f"trainyard.{group}.{name}." in section, name


def test_a_relaunch_sends_where_its_seconds_went(tmp_path: Path) -> None:
    """Issue 53, item 4: the fault's restart, restore and replay as live timers, beside detection."""
    ledger = Ledger(tmp_path / "events.jsonl")
    at = time.time() - 100
    with mock.patch("trainyard.events.ledger.time.time", side_effect=[at + t for t in (0, 1, 2, 3, 5, 6, 7)]):
        ledger.append("train", "attempt_start", attempt=1)
        ledger.append("train", "step", step=1, step_ms=1000)
        ledger.append("train", "failure_classified", attempt=1, kind="node_lost", detected_at=at + 1.5)
        ledger.append("train", "attempt_start", attempt=2)
        ledger.append("train", "resumed", step=1, seconds=1.5)
        ledger.append("train", "step", step=2, step_ms=1000)
        ledger.append("train", "stage_end", seconds=7.0)
    sent = {m.name.rsplit(".", 1)[0]: m.value for m in recovery_metrics(ledger, DAG)}
    assert sent["trainyard.recovery.restart"] == 1500.0 and sent["trainyard.recovery.restore"] == 2500.0
    assert sent["trainyard.recovery.replay"] == 0.0

"""examples/dags/custom_pipeline.py, a DAG written by hand with trainyard's operators, through a real ``airflow dags
test`` run: every stage as a plain operator, and the checkpoint published from its evaluation's result, after it.
(An evaluation that fails leaves publish upstream_failed, as any Airflow task does; one run is what CI can afford.)
The same run reports its lineage through the OpenLineage provider's file transport, and its training's live metrics
to an OTLP receiver, as to the collector a deployment runs."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from airflow_helpers import ROOT, airflow, airflow_env, query, run_state, task_states
from otlp_receiver import Export, OtlpReceiver

from trainyard.protocol.live_metrics import INSTRUMENTS, SERVICE

pytestmark = pytest.mark.integration
DAG_ID = "custom_pipeline"
EVERY_S = 1.0
TASKS = ["pin_spec", "stage_dataset", "check_dataset", "pressure_test", "train", "check_checkpoint", "evaluate"]


def test_a_hand_written_dag_publishes_only_what_its_evaluation_passes(tmp_path: Path) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "examples" / "dags" / "custom_pipeline.py", dags)
    spec = yaml.safe_load((ROOT / "examples" / "dags" / "custom_pipeline.yaml").read_text())
    # Cut down to seconds, as the other Airflow-run tests do: this is about the DAG's wiring, not the stages.
    spec["nodes"] = {"count": 1, "min": 1, "backend": "local"}
    spec["pressure_test"] = {"enabled": False}
    # Steps enough for the live metrics to be sent more than once (each second at most).
    spec["training"].update(max_steps=60, checkpoint_every=30, global_batch=4, micro_batch=4, checkpoint_async=False,
                            progress_every_s=EVERY_S)  # fmt: skip
    (dags / "custom_pipeline.yaml").write_text(yaml.safe_dump(spec))
    lineage = tmp_path / "openlineage.jsonl"
    # OpenLineage's file transport, as a data platform's HTTP transport would be configured.
    transport = {"type": "file", "log_file_path": str(lineage), "append": True}
    with OtlpReceiver() as receiver:
        # The standard OpenTelemetry variable, as Airflow's own metrics are configured.
        env = airflow_env(tmp_path, dags, AIRFLOW__OPENLINEAGE__TRANSPORT=json.dumps(transport),
                          OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=receiver.url)  # fmt: skip
        subprocess.run(["trainyard", "demo-data", "--date", "2026-11-28"], env=env, check=True, capture_output=True)
        done = airflow(env, "dags", "test", DAG_ID, "2026-11-28")
    published = Path(env["TRAINYARD_HOME"]) / "cold" / "checkpoints" / DAG_ID
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    states = {t: s for t, (s, _) in task_states(env, DAG_ID, "2026-11-28").items()}
    assert states == dict.fromkeys([*TASKS, "publish", "report"], "success"), states
    assert run_state(env, DAG_ID, "2026-11-28") == "success"
    [(evaluated_end, publish_start)] = query(
        env,
        "SELECT e.end_date, p.start_date FROM task_instance e JOIN task_instance p ON e.run_id = p.run_id"
        " WHERE e.dag_id = :d AND p.dag_id = :d AND e.task_id = 'evaluate' AND p.task_id = 'publish'",
        d=DAG_ID,
    )
    assert evaluated_end <= publish_start  # published after the evaluation, from its result
    first = json.loads((published / "PUBLISHED").read_text())
    assert first["path"].startswith("step_000060.")
    check_lineage(lineage, Path(env["TRAINYARD_HOME"]), published / first["path"])
    check_live_metrics(receiver.exports, receiver.refused)


def check_live_metrics(exports: list[Export], refused: list[str]) -> None:
    """Rank 0 pushed every metric, labelled with its run, at most once a second, the last at the last step."""
    assert exports and not refused, refused
    assert {e.service for e in exports} == {SERVICE}
    last = exports[-1]
    assert set(last.points) == {name for name, _, _ in INSTRUMENTS.values()}
    for points in last.points.values():
        [(_, labels)] = points  # one process, rank 0, exports
        assert labels["pipeline"] == DAG_ID and labels["run_id"].startswith("manual__") and labels["node"]

    def value(key: str) -> float | None:
        return last.value(INSTRUMENTS[key][0])

    assert value("step") == 60 and value("world_size") == 1 and value("attempt") == 1 and value("regroups") == 0
    assert 0 < (value("loss") or 0) < 10 and (value("step_seconds") or 0) > 0 and (value("tokens_per_second") or 0) > 0
    assert 0 <= (value("checkpoint_age_seconds") or -1) < 600
    # The reader's period is progress_every_s; the last export is the one at exit.
    periodic = [b.at - a.at for a, b in itertools.pairwise(exports[:-1])]
    assert all(gap >= 0.9 * EVERY_S for gap in periodic), periodic


def check_lineage(events_file: Path, home: Path, copy: Path) -> None:
    """Each stage's COMPLETE event names what it read and wrote: source -> staged -> checkpoint -> published."""
    done: dict[str, dict] = {}
    for line in events_file.read_text().splitlines():
        event = json.loads(line)
        task = event["job"]["name"].rsplit(".", 1)[-1]
        if event["eventType"] == "COMPLETE" and event["job"]["name"].startswith(f"{DAG_ID}."):
            done[task] = event

    def names(task: str, side: str) -> list[tuple[str, str]]:
        return [(d["namespace"], d["name"]) for d in done[task][side]]

    staged = str(home / "hot" / "custom-finetune")
    checkpoint = str(home / "checkpoints" / DAG_ID / "step_000060")
    assert names("stage_dataset", "inputs") == [("file", str(home / "cold" / "finetune"))]
    assert names("stage_dataset", "outputs") == [("file", staged)]
    assert names("check_dataset", "inputs") == [("file", staged)]
    assert names("train", "inputs") == [("file", staged)] and names("train", "outputs") == [("file", checkpoint)]
    assert names("check_checkpoint", "inputs") == [("file", checkpoint)]
    assert names("publish", "inputs") == [("file", checkpoint)] and names("publish", "outputs") == [("file", str(copy))]

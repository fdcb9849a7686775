"""A task takes only its own run's folder from an XCom (issue 49, hole 10), and the admin's settings reach the
spec layer from ``airflow.cfg`` (hole 8).

``run_file`` is an XCom: DAG A's report given pipeline B's ``spec.json`` released B's lineage lease while B
trained. Every operator reopens the run through ``tasks.open_pinned``, which now takes only the snapshot in
this DAG's and this run's folder under the runs root of the task's own spec.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from trainyard.airflow import tasks
from trainyard.checkpoint import lease
from trainyard.errors import SpecError
from trainyard.pipeline.run import SNAPSHOT, open_run

SPEC = """\
dataset: {{source: "file://{root}/cold/tokens", name: {name}}}
nodes: {{count: 1}}
training: {{max_steps: 2, global_batch: 2, micro_batch: 1, checkpoint_every: 1}}
checkpoint: {{hot: "file://{root}/hot", cold: "file://{root}/cold/checkpoints"}}
runs_root: "file://{root}/runs"
"""


def spec(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(SPEC.format(root=tmp_path, name=name))
    return path


@pytest.fixture
def task_of(monkeypatch: pytest.MonkeyPatch):
    """Run the adapters as a task of ``dag_id``'s run ``run_id`` would."""

    def within(dag_id: str, run_id: str) -> None:
        context = {"dag": SimpleNamespace(dag_id=dag_id), "run_id": run_id, "ds": "2026-01-01", "params": {}}
        monkeypatch.setattr(tasks, "get_current_context", lambda: context)

    return within


def test_a_report_given_another_pipelines_run_file_releases_nothing_of_it(tmp_path: Path, task_of) -> None:
    theirs = open_run(spec(tmp_path, "b"), "b", "manual__1", "2026-01-01")
    lease.hold(theirs.checkpoint_root, "b", theirs.run_id, theirs.ledger, ttl_s=3600.0)
    task_of("a", "manual__1")
    with pytest.raises(AirflowFailException, match="is not this run's pinned spec"):
        tasks.report(str(spec(tmp_path, "a")), str(theirs.dir / SNAPSHOT))
    held = lease.read_claim(theirs.checkpoint_root)
    assert held is not None and held.run_id == theirs.run_id, "A's report released B's lineage"


def test_another_run_of_the_same_dag_is_not_this_runs_folder(tmp_path: Path, task_of) -> None:
    path = spec(tmp_path, "a")
    earlier = open_run(path, "a", "manual__0", "2026-01-01")
    task_of("a", "manual__1")
    with pytest.raises(SpecError, match="is not this run's pinned spec"):
        tasks.open_pinned(str(path), str(earlier.dir / SNAPSHOT))


def test_a_snapshot_in_this_runs_folder_that_pins_another_run_is_refused(tmp_path: Path, task_of) -> None:
    path = spec(tmp_path, "a")
    run = open_run(path, "a", "manual__1", "2026-01-01")
    snapshot = run.dir / SNAPSHOT
    snapshot.write_text(snapshot.read_text().replace('"manual__1"', '"manual__0"'))
    task_of("a", "manual__1")
    with pytest.raises(SpecError, match="pins run 'manual__0' of 'a', not this task's run"):
        tasks.open_pinned(str(path), str(snapshot))


def test_the_runs_own_run_file_opens_the_pinned_run(tmp_path: Path, task_of) -> None:
    path = spec(tmp_path, "a")
    run = open_run(path, "a", "manual__1", "2026-01-01")
    task_of("a", "manual__1")
    opened = tasks.open_pinned(str(path), str(run.dir / SNAPSHOT))
    assert (opened.dag_id, opened.run_id, opened.dir) == ("a", "manual__1", run.dir)


def test_the_admins_allow_lists_in_airflow_cfg_reach_the_spec_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainyard.airflow import operators
    from trainyard.spec.admin import pod_service_accounts
    from trainyard.spec.templating import allowed_variables

    monkeypatch.delenv("AIRFLOW__TRAINYARD__SPEC_VARIABLES", raising=False)
    monkeypatch.delenv("AIRFLOW__TRAINYARD__POD_SERVICE_ACCOUNTS", raising=False)
    cfg = {"spec_variables": "CKPT_ROOT", "pod_service_accounts": "team-a-trainer"}
    monkeypatch.setattr(operators.conf, "get", lambda section, option, fallback=None: cfg.get(option, fallback))
    operators.export_admin_settings()
    assert "CKPT_ROOT" in allowed_variables() and "team-a-trainer" in pod_service_accounts()

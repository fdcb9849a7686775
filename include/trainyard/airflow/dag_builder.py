"""Build one Airflow DAG per pipeline spec.

Parsing reads the spec files and nothing else (no I/O on tiers, no imports of
torch), so the DAG processor stays fast. A broken spec must not hide the
others: valid specs become DAGs, and every problem of the broken ones is
reported as one import error of the DAG file, naming each file and field.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Param, task

from trainyard.airflow import tasks
from trainyard.errors import SpecError
from trainyard.spec import PipelineSpec, load_spec, param_schemas

def build_dag(spec_path: Path, spec: PipelineSpec) -> DAG:
    dag_id = spec.dag_id(spec_path)
    rec = spec.recovery
    with DAG(
        dag_id=dag_id,
        description=spec.description or f"trainyard pipeline from {spec_path.name}",
        schedule=spec.schedule,
        start_date=dt.datetime.combine(spec.start_date, dt.time(), tzinfo=dt.timezone.utc),
        catchup=spec.catchup,
        max_active_runs=spec.max_active_runs,
        tags=["trainyard", *spec.tags],
        params={name: Param(**schema) for name, schema in param_schemas(spec).items()},
        default_args={"owner": spec.owner, "retries": 0},
        doc_md=f"Built by trainyard from `{spec_path}`.",
    ) as dag:
        path = str(spec_path)
        stage = task(task_id="stage_dataset", retries=2, retry_delay=dt.timedelta(seconds=rec.backoff_s))(tasks.stage_dataset)(path)
        check = task(task_id="check_dataset")(tasks.check_dataset)(path)
        burn = task(task_id="burn_in")(tasks.burn_in)(path)
        # Each retry of ``train`` is a new attempt that resumes from the latest valid checkpoint.
        trained = task(task_id="train", retries=rec.max_attempts - 1, retry_delay=dt.timedelta(seconds=rec.backoff_s))(tasks.train)(path, burn)
        checked = task(task_id="check_checkpoint")(tasks.check_checkpoint)(path, trained)
        published = task(task_id="publish", retries=2)(tasks.publish)(path, checked)
        # The report is written whatever happened: a failed run needs it most.
        reported = task(task_id="report", trigger_rule="all_done")(tasks.report)(path)
        stage >> check >> burn
        published >> reported
    return dag


def _broken_specs_dag(problems: list[str]) -> DAG:
    """A DAG that fails validation with every spec problem as its message.

    Airflow records a DAG's validation error as an import error of the file it
    came from and still keeps the file's other DAGs: exactly what we want.
    """
    dag = DAG(dag_id="trainyard_invalid_specs", schedule=None)

    def fail_validation() -> None:
        raise SpecError(["invalid pipeline spec(s); fix and the DAG appears:", *problems])

    dag.validate = fail_validation  # type: ignore[method-assign]
    return dag


def build_dags(folder: str | Path) -> dict[str, Any]:
    """``{dag_id: DAG}`` for every ``*.yaml`` in ``folder``, plus the broken-spec sentinel if any fail."""
    dags: dict[str, Any] = {}
    problems: list[str] = []
    for spec_path in sorted(Path(folder).glob("*.y*ml")):
        try:
            spec = load_spec(spec_path)
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        dag_id = spec.dag_id(spec_path)
        if dag_id in dags:
            problems.append(f"{spec_path}: pipeline: DAG id {dag_id!r} is already used by another spec")
            continue
        dags[dag_id] = build_dag(spec_path, spec)
    if problems:
        dags["trainyard_invalid_specs"] = _broken_specs_dag(problems)
    return dags

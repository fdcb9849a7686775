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
from trainyard.airflow.notify import dag_callbacks
from trainyard.airflow.operators import (
    CheckDatasetOperator,
    CheckpointGateOperator,
    PressureTestOperator,
    PublishOperator,
    ReportOperator,
    StageDatasetOperator,
    TrainOperator,
)
from trainyard.airflow.params import param_schemas
from trainyard.errors import SpecError
from trainyard.report.pages import URL_PREFIX
from trainyard.spec import PipelineSpec, load_spec, nested_specs
from trainyard.spec.ids import dag_id_problems, duplicate_ids

# Airflow pool of training nodes (airflow_settings.yaml declares it): one slot per node.
NODE_POOL = "training_nodes"


def node_slots(spec: PipelineSpec) -> dict[str, int]:
    """Pool slots of the tasks that occupy nodes, by task id.

    Slots are fixed when the DAG is parsed, but the ``nodes`` Param can raise
    the count when a run is triggered, so each task takes the most nodes any
    run of this spec may use: ``nodes.upper`` (``nodes.max``, else count +
    spare) for ``train``, which never runs on more than the count (a spare only
    replaces a lost node), and upper + spare for ``burn_in``, which tests every
    candidate at once. Concurrent pipelines then never oversubscribe, at the
    price of holding the unused slots of a run that asked for fewer. burn_in
    takes slots too: its probes measured on nodes another pipeline trains on
    would evict healthy nodes as stragglers and slow that training down.
    A spec whose slots exceed the pool's size never runs (the scheduler
    starves the task), so the pool must be at least the largest of these.
    """
    upper = spec.nodes.upper
    return {"burn_in": upper + spec.nodes.spare, "train": upper}


def build_dag(spec_path: Path, spec: PipelineSpec) -> DAG:
    dag_id = spec.dag_id(spec_path)
    rec = spec.recovery
    schemas = param_schemas(spec)
    with DAG(
        dag_id=dag_id,
        description=spec.description or f"trainyard pipeline from {spec_path.name}",
        schedule=spec.schedule,
        start_date=dt.datetime.combine(spec.start_date, dt.time(), tzinfo=dt.UTC),
        catchup=spec.catchup,
        max_active_runs=spec.max_active_runs,
        tags=["trainyard", *spec.tags],
        params={name: Param(**schema) for name, schema in schemas.items()},
        default_args={"owner": spec.owner, "retries": 0},
        doc_md=dag_doc(spec_path, spec, schemas),
        **dag_callbacks(str(spec_path), spec),
    ) as dag:
        # The run's spec (file + the trigger's Params) is pinned once, here; every later task reads the snapshot.
        path = str(spec_path)
        pinned = task(task_id="pin_spec")(tasks.pin_spec)(path)
        run: dict[str, Any] = {"spec": path, "run_file": pinned}
        stage = StageDatasetOperator(
            task_id="stage_dataset", retries=2, retry_delay=dt.timedelta(seconds=rec.backoff_s), **run
        )
        check = CheckDatasetOperator(task_id="check_dataset", **run)
        slots = node_slots(spec)
        burn = PressureTestOperator(task_id="burn_in", pool=NODE_POOL, pool_slots=slots["burn_in"], **run)
        # The supervisor inside ``train`` retries, scales down and rolls back itself; Airflow's one
        # retry is for the task process dying, and it carries on from the ledger.
        trained = TrainOperator(
            task_id="train",
            nodes=burn.output,
            retries=1,
            retry_delay=dt.timedelta(seconds=rec.backoff_s),
            pool=NODE_POOL,
            pool_slots=slots["train"],
            **run,
        )
        checked = CheckpointGateOperator(task_id="check_checkpoint", trained=trained.output, **run)
        published = PublishOperator(task_id="publish", gate=checked.output, retries=2, **run)
        # The report is written whatever happened (a failed run needs it most), and the run's state must
        # still say what happened. A teardown gives both: it runs once its setup (pin_spec) succeeded and
        # everything before it is done, and it is no leaf, so a failed stage fails the DAG run (a report
        # with trigger_rule="all_done" as the only leaf turned every failed night green). It must keep
        # on_failure_fail_dagrun False: True makes it the one leaf that decides, and a written report
        # would turn a failed night green again. A report that fails shows as a failed task.
        reported = ReportOperator(task_id="report", **run)
        stage >> check >> burn
        published >> reported
        # What as_teardown(setups=pinned) does, whose annotation takes operators only.
        pinned.as_setup() >> reported.as_teardown()
    return dag


def dag_doc(spec_path: Path, spec: PipelineSpec, schemas: dict[str, dict[str, Any]]) -> str:
    """The DAG's page text: the spec's description, where it comes from, its Params and the runs view."""
    lines = [
        spec.description or f"trainyard pipeline from `{spec_path.name}`.",
        "",
        f"Built by trainyard from `{spec_path}`; each run pins this file (with the trigger's Params) when it"
        " starts, so an edit takes effect from the next run.",
        "",
    ]
    if schemas:
        lines += ["| Param | default | what it sets |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | `{s.get('default')}` | {s.get('description', '')} |" for name, s in schemas.items()]
        lines.append("")
    # Host-relative: the API server serves the view under its own host (and any base URL in front of it).
    lines.append(
        f'Runs of this pipeline: [training-runs view]({URL_PREFIX}/) (and the "Training run" tab of'
        ' each DAG run, or the "Training run" link of its train and report tasks).'
    )
    return "\n".join(lines)


def scan(folder: str | Path) -> tuple[dict[str, tuple[Path, PipelineSpec]], list[str]]:
    """Valid specs by DAG id, and one line per problem of the others."""
    valid: dict[Path, PipelineSpec] = {}
    problems: list[str] = []
    for spec_path in sorted(Path(folder).glob("*.y*ml")):
        try:
            spec = load_spec(spec_path)
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        # A file name Airflow refuses as a DAG id would raise in DAG() and take every pipeline of this file down.
        if bad := dag_id_problems(spec_path, spec):
            problems.extend(f"{spec_path}: {line}" for line in bad)
            continue
        valid[spec_path] = spec
    duplicates = duplicate_ids(valid)
    problems.extend(f"{path}: {line}" for path, line in duplicates.items())
    valid = {path: spec for path, spec in valid.items() if path not in duplicates}
    # Staging or evicting a dataset folder nested in another's would touch that pipeline's files.
    nested = nested_specs(valid)
    problems.extend(nested.values())
    return {spec.dag_id(path): (path, spec) for path, spec in valid.items() if path not in nested}, problems


def build_dags(folder: str | Path) -> dict[str, DAG]:
    """``{dag_id: DAG}`` for every valid ``*.yaml`` spec in ``folder``; invalid ones are skipped."""
    valid, _ = scan(folder)
    return {dag_id: build_dag(path, spec) for dag_id, (path, spec) in valid.items()}


def raise_spec_problems(folder: str | Path) -> None:
    """Raise one ``SpecError`` naming every invalid spec's file and field.

    Called from its own DAG file: Airflow 3 marks every DAG of a file with an
    import error as stale, so the error must come from a file other than the
    one that builds the valid pipelines.
    """
    _, problems = scan(folder)
    if problems:
        raise SpecError(["invalid pipeline spec(s); fix them and their DAGs appear:", *problems])

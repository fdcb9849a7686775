"""Fault drills end to end: run a pipeline with one fault and check the outcome is the expected one.

``trainyard drill SPEC --fault kill --node node-1 --step 10`` runs the spec's
stages in this process (no Airflow) with the fault acted out in the first
training attempt, then compares what the supervisor did with what it should
do, and prints the recovery figures. A drill that cannot be acted out for the spec's script is refused with
the reason: before the run by the spec check (``spec.checks.drill_refusal``), or during it by the supervisor
(``recovery.drills``: a ``drill_refused`` event), and the report says so instead of a bare "UNEXPECTED".
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainyard.errors import TrainingFailed
from trainyard.events.fold import fold
from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.recovery.figures import figures_from
from trainyard.spec import Drill, load_spec, spec_from_data
from trainyard.spec.templating import render

# What each fault should lead to: the recovery action taken (None: no failure at all) and the end.
EXPECTED: dict[str, tuple[str | None, str]] = {
    "kill": ("scale_down", "succeeded"),
    "hang": ("scale_down", "succeeded"),
    "slow": (None, "succeeded"),
    "corrupt_checkpoint": (None, "succeeded"),
    "nan": ("rollback", "succeeded"),
    "oom": ("retry", "succeeded"),
    "exception": ("fail", "failed"),
    "preempt": ("retry", "succeeded"),
}


@dataclass(frozen=True)
class DrillReport:
    fault: str
    actions: list[str]
    end: str
    expected: tuple[str | None, str]
    figures: dict[str, Any]
    run_dir: Path
    refused: list[str] = field(default_factory=list)
    """Why the drill was not acted out (``drill_refused``); empty: it was, or nothing said otherwise."""

    @property
    def ok(self) -> bool:
        action, end = self.expected
        acted = self.end == end and (self.actions == [] if action is None else action in self.actions)
        return acted and not self.refused


def run_drill(spec_path: Path, drill: Drill, ds: str | None = None, run_id: str | None = None) -> DrillReport:
    """Stage, check, burn in and train with ``drill`` in the first attempt, on scratch checkpoint and run
    roots under ``$TRAINYARD_HOME/drills``; no checkpoint gate, no publish."""
    # A rehearsal never touches the pipeline's checkpoints: fresh start, its own roots.
    scratch = Path(render("${TRAINYARD_HOME}", {})) / "drills" / f"{drill.fault}-{time.time_ns()}"
    data = load_spec(spec_path).model_dump(mode="json", exclude_unset=True)
    data.update(
        drills=[drill.model_dump()],
        runs_root=f"file://{scratch}/runs",
        training={**data["training"], "resume_from": "none"},
        checkpoint={
            **data.get("checkpoint", {}),
            "hot": f"file://{scratch}/checkpoints",
            "cold": f"file://{scratch}/cold",
            "connection": None,
            "lifecycle": None,
        },
    )
    spec = spec_from_data(data, spec_path)
    # The drilled spec lives outside the DAG folder, so no DAG is ever built from it.
    path = Path(tempfile.mkdtemp(prefix="trainyard-drill-")) / spec_path.name
    path.write_text(_yaml(spec.model_dump(mode="json", exclude_unset=True)))
    try:
        run = open_run(
            path,
            spec.dag_id(spec_path),
            run_id or f"drill__{drill.fault}__{time.time_ns()}",
            ds or time.strftime("%Y-%m-%d"),
        )
        stages.stage_dataset(run)
        stages.check_dataset(run)
        chosen = stages.burn_in(run)
        try:
            stages.train(run, chosen.healthy, spares=chosen.spare)
            end = "succeeded"
        except TrainingFailed:
            end = "failed"
        stages.report(run)  # releases the staged dataset's pin and writes the drill's report
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    state = fold(run.ledger.events("train"))  # once, for the decisions, the refusals and the figures
    actions: list[str] = [d.action for d in state.train.decisions]
    refused = [why for fault, why in state.train.drills_refused if fault == drill.fault]
    return DrillReport(drill.fault, actions, end, EXPECTED[drill.fault], figures_from(state), run.dir,
                       refused)  # fmt: skip


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)

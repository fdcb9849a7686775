"""Fault drills end to end: run a pipeline with one fault and check the outcome is the expected one.

``trainyard drill SPEC --fault kill --node node-1 --step 10`` runs the spec's
stages in this process (no Airflow) with the fault acted out in the first
training attempt, then compares what the supervisor did with what it should
do, and prints the recovery figures.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard import stages
from trainyard.errors import TrainingFailed
from trainyard.recovery.figures import recovery_figures
from trainyard.run import open_run
from trainyard.spec import Drill, load_spec, spec_from_data

# What each fault should lead to: the recovery action taken (None: no failure at all) and the end.
EXPECTED: dict[str, tuple[str | None, str]] = {
    "kill": ("scaledown", "succeeded"),
    "hang": ("scaledown", "succeeded"),
    "slow": (None, "succeeded"),
    "corrupt_checkpoint": (None, "succeeded"),
    "nan": ("rollback", "succeeded"),
    "oom": ("retry", "succeeded"),
    "exception": ("fail", "failed"),
}


@dataclass(frozen=True)
class DrillReport:
    fault: str
    actions: list[str]
    end: str
    expected: tuple[str | None, str]
    figures: dict[str, Any]
    run_dir: Path

    @property
    def ok(self) -> bool:
        action, end = self.expected
        return self.end == end and (self.actions == [] if action is None else action in self.actions)


def run_drill(spec_path: Path, drill: Drill, run_id: str | None = None) -> DrillReport:
    """Stage, check, burn in and train with ``drill`` in the first attempt; no checkpoint gate or publish."""
    base = load_spec(spec_path)
    spec = spec_from_data({**base.model_dump(mode="json", exclude_unset=True), "drills": [drill.model_dump()]}, spec_path)
    # The drilled spec lives outside the DAG folder, so no DAG is ever built from it.
    path = Path(tempfile.mkdtemp(prefix="trainyard-drill-")) / spec_path.name
    path.write_text(_yaml(spec.model_dump(mode="json", exclude_unset=True)))
    try:
        run = open_run(path, spec.dag_id(spec_path), run_id or f"drill__{drill.fault}__{time.time_ns()}", time.strftime("%Y-%m-%d"))
        stages.stage_dataset(run)
        stages.check_dataset(run)
        chosen = stages.burn_in(run)
        try:
            stages.train(run, chosen["healthy"], spares=chosen.get("spare", []))
            end = "succeeded"
        except TrainingFailed:
            end = "failed"
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    actions = [e["action"] for e in run.ledger.events("train", "decision")]
    return DrillReport(drill.fault, actions, end, EXPECTED[drill.fault], recovery_figures(run.ledger), run.dir)


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)

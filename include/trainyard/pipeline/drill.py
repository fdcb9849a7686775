"""Fault drills end to end: run a pipeline with one fault and check the outcome is the expected one.

``trainyard drill SPEC --fault kill --node node-1 --step 10`` runs the spec's
stages in this process (no Airflow) with the fault acted out in the first
training attempt, then compares what the supervisor did with what it should
do, and prints the recovery figures. What it should do is the policy's own answer (``recovery.policy.decide``)
for the failure the fault makes, on the spec and the nodes the pressure test chose, on the path the run took
(in place where the attempt could regroup, else relaunch): never a second copy of the policy's rules. A drill that cannot be acted out for the spec's script is refused with
the reason: before the run by the spec check (``spec.checks.drill_refusal``), or during it by the supervisor
(``recovery.drills``: a ``drill_refused`` event), and the report says so instead of a bare "UNEXPECTED".
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from trainyard.errors import TrainingFailed
from trainyard.events.fold import fold
from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.recovery.classify import Classified
from trainyard.recovery.figures import figures_from
from trainyard.recovery.policy import GiveUp, InPlace, Situation, decide
from trainyard.spec import Drill, FailureKind, PipelineSpec, load_spec, spec_from_data
from trainyard.spec.templating import render


@dataclass(frozen=True)
class Fault:
    """What a drill's fault is to the supervisor: the failure kind it is classified as (None: no failure, the run
    trains through it), and what its node is to that failure."""

    kind: FailureKind | None
    node: Literal["culprit", "leaving", "none"] = "none"
    """``culprit``: blamed (left out of the next world); ``leaving``: given notice, never blamed."""


FAULTS: dict[str, Fault] = {
    "kill": Fault("node_lost", "culprit"),
    "hang": Fault("hang", "culprit"),
    "slow": Fault(None),  # a straggler is slow, not failed
    "corrupt_checkpoint": Fault(None),  # the save is judged invalid and resuming skips it; nothing fails
    "nan": Fault("diverged"),
    "oom": Fault("oom", "culprit"),
    "exception": Fault("user_error"),
    "preempt": Fault("preempted", "leaving"),
}
if set(FAULTS) != set(get_args(Drill.model_fields["fault"].annotation)):  # pragma: no cover - a fault half declared
    raise ImportError(f"pipeline.drill.FAULTS {sorted(FAULTS)} != spec Drill.fault")


@dataclass(frozen=True)
class Expected:
    """What a drill should lead to: the first recovery action (None: no failure at all), the run's end, and the
    policy's reason (which says the path, in place or relaunch, and why)."""

    action: str | None
    end: str
    reason: str = ""


def expected(spec: PipelineSpec, drill: Drill, nodes: list[str], spares: list[str], why_not: str) -> Expected:
    """The policy's decision about ``drill``'s failure in the first attempt of a fresh start on ``nodes`` (the
    pressure test's choice; ``spares`` its healthy rest); ``why_not``: why the attempt cannot regroup in place
    ("" when it can: ``train.in_place_why_not``, or the script's ranks never formed a group)."""
    fault = FAULTS[drill.fault]
    if fault.kind is None:
        return Expected(None, "succeeded", f"{drill.fault} is no failure: training goes on")
    node = [drill.node or nodes[0]]  # recovery.drills.target: null is the attempt's first node
    failure = Classified(fault.kind, f"drill {drill.fault}", culprits=node if fault.node == "culprit" else [],
                         step=drill.step, leaving=node if fault.node == "leaving" else [])  # fmt: skip
    training, every = spec.training, spec.training.checkpoint_every
    situation = Situation(
        nodes=list(nodes),
        spares=list(spares),
        min_nodes=spec.nodes.min,
        procs_per_node=spec.nodes.procs_per_node,
        global_batch=training.global_batch,
        micro_batch=training.micro_batch,
        valid_steps=list(range(every, drill.step, every)),  # the saves before the fault, fresh start
        in_place=InPlace(not why_not, why_not),
    )
    decision = decide([], failure, situation, spec.recovery)
    return Expected(decision.action, "failed" if isinstance(decision, GiveUp) else "succeeded", decision.reason)


@dataclass(frozen=True)
class DrillReport:
    fault: str
    actions: list[str]
    end: str
    expected: Expected
    figures: dict[str, Any]
    run_dir: Path
    refused: list[str] = field(default_factory=list)
    """Why the drill was not acted out (``drill_refused``); empty: it was, or nothing said otherwise."""

    @property
    def ok(self) -> bool:
        action, end = self.expected.action, self.expected.end
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
    # The path the run took: the stage's from the spec and backend, or the later one of a script whose ranks
    # never formed a group (no recovery_path at all: the stage never started; nothing regroups).
    why_not = "" if state.train.in_place else (state.train.why_not or "the train stage said no recovery path")
    want = expected(spec, drill, chosen.healthy, chosen.spare, why_not)
    return DrillReport(drill.fault, actions, end, want, figures_from(state), run.dir, refused)


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)

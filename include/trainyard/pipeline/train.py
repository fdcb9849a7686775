"""The train stage: plan each attempt, supervise it (blocking) or defer on it, recover until done.

``TrainStage`` wires the stage once for a run -- the controller's context, the drivers' hooks, the attempt
plans -- and runs it with either driver: ``run_blocking()`` supervises in this process; ``begin()`` (when
the task starts) and ``resume(news)`` (at each wake) run the deferred driver one wake at a time. Both
record the same events through the one stage recorder, ``recovery_path`` included. Whether a run defers
is ``pipeline.run.defers``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainyard import held
from trainyard.atomic import UnsafePath
from trainyard.backends.base import (
    CoordinationStore,
    Launcher,
    LaunchPlan,
    RegroupingLauncher,
    ServesStores,
    SignalsNodes,
)
from trainyard.backends.registry import backend_for
from trainyard.checkpoint import lease, putback
from trainyard.errors import LineageBusy
from trainyard.pipeline import lineage
from trainyard.pipeline.command import attempt_command
from trainyard.pipeline.lineage import final_checkpoint, hold_lineage, hot_checkpoints, resume_point, rollback, watcher
from trainyard.pipeline.recorder import StageRecorder
from trainyard.pipeline.results import TrainResult
from trainyard.pipeline.run import Run, defers, wake_every_s
from trainyard.protocol.env import FaultDrill, TrainEnv
from trainyard.protocol.live_metrics import otlp_endpoint
from trainyard.recovery.commands import AttemptResult
from trainyard.recovery.deferred import Deferral, Deferred, Done, Outcome, Pace
from trainyard.recovery.figures import recovery_figures
from trainyard.recovery.logwatch import LogSteps
from trainyard.recovery.observations import BackoffOver, Checkpoints, Context, Reported
from trainyard.recovery.progress import ProgressLog, tokens_per_step
from trainyard.recovery.state import Course
from trainyard.recovery.storehost import StoreHost
from trainyard.recovery.supervisor import Hooks, StateReader, supervise
from trainyard.spec import Drill
from trainyard.spec.args import named
from trainyard.spec.checks import acts_drills
from trainyard.storage.boot import ensure_this_boot

STAGE = "train"
# Only a process that stays can serve the store an attempt's ranks regroup on, unless the backend serves one.
DEFERRED_WHY_NOT = "the train task defers: no process of it stays to serve the store the ranks regroup on"

log = logging.getLogger(__name__)


def in_place_why_not(run: Run, launcher: Launcher) -> str:
    """Why this run's attempts cannot regroup in place ("" when they can): the backend and the shape.

    Any entrypoint may: whether its script trains through the elastic group shows only once its ranks run
    (a failure before any group formed on the store is relaunched, and says so: ``supervisor.UNGROUPED``)."""
    spec = run.spec
    if not spec.recovery.in_place:
        return "recovery.in_place is false"
    if not isinstance(launcher, RegroupingLauncher):
        return f"the {spec.nodes.backend} backend relaunches (its nodes cannot change while an attempt runs)"
    if defers(spec.nodes) and not isinstance(launcher, ServesStores):
        return DEFERRED_WHY_NOT
    if spec.nodes.gpus_per_node:
        # The NCCL path (runtime.collectives) is built but has not yet run on a GPU: bench/gpu_check.sh's drill first.
        return "in place on GPU nodes awaits its first run on GPUs (bench/gpu_check.sh); nodes.gpus_per_node 0 regroups"
    return ""


def train(
    run: Run,
    nodes: list[str],
    launcher: Launcher | None = None,
    spares: list[str] | None = None,
    run_state: lease.RunState | None = None,
) -> TrainResult:
    """Train on ``nodes`` in this process, recovering from failures until done or the policy says stop
    (``TrainStage.run_blocking``; the library's callers: drills, benches, tests)."""
    return TrainStage.of(run, nodes, launcher, spares, run_state).run_blocking()


@dataclass
class TrainStage:
    """The train stage of one run on the nodes burn-in chose.

    ``launcher`` is the backend; the caller keeps it to end the attempt from
    outside (a killed task). ``spares`` are healthy nodes the pressure test
    did not pick, for replacing lost ones. A retried task carries on from the
    ledger: attempt numbers, nodes and micro-batch. The run holds the lineage
    throughout, renewing its lease at every poll or wake (``run_state``: see
    ``hold_lineage``); losing it ends the attempt.
    """

    run: Run
    nodes: list[str]
    launcher: Launcher
    spares: list[str] = field(default_factory=list)
    run_state: lease.RunState | None = None

    @classmethod
    def of(
        cls,
        run: Run,
        nodes: list[str],
        launcher: Launcher | None = None,
        spares: list[str] | None = None,
        run_state: lease.RunState | None = None,
    ) -> TrainStage:
        """The stage, on local processes unless ``launcher`` says otherwise."""
        if launcher is None:
            launcher = backend_for(run.spec.nodes).launcher()
        return cls(run, list(nodes), launcher, list(spares or []), run_state)

    @property
    def defers(self) -> bool:
        """Whether the task runs this stage deferred (``begin``, ``resume``) rather than ``run_blocking``."""
        return defers(self.run.spec.nodes)

    def run_blocking(self) -> TrainResult:
        """Supervise every attempt in this process until the run is trained (or ``TrainingFailed``)."""
        run = self.run
        stage = StageRecorder.start(run, STAGE)
        with stage.failures():
            ensure_this_boot(run.hot_dataset_dir, run.ledger, STAGE)  # a reboot since check_dataset: re-verify first
            held = hold_lineage(run, self.run_state)
            _, start = resume_point(run, held)
            target = start + run.spec.training.max_steps
            why_not = in_place_why_not(run, self.launcher)
            store = self._store(target) if not why_not else None
            stage.note("recovery_path", in_place=not why_not, why_not=why_not)
            with watcher(run) as judged:
                try:
                    result = supervise(
                        self.launcher,
                        run.ledger,
                        self._context(elastic=store is not None),
                        self._hooks(target, store=store, catch_up=judged.catch_up),
                        run.spec.training.heartbeat_timeout_s,
                        keep_alive=held.keep,
                        startup_grace_s=run.spec.training.startup_grace_s,
                    )
                finally:
                    drop_snapshots(run)
            trained = self._result(start, target, result)
        stage.end(trained)
        return trained

    def begin(self) -> Deferral | TrainResult:
        """The deferred task starts: launch the run's next attempt, or re-attach to one an earlier task
        process left running; what to wait on, or the result."""
        run = self.run
        stage = StageRecorder.start(run, STAGE)
        with stage.failures():
            ensure_this_boot(run.hot_dataset_dir, run.ledger, STAGE)  # before the launch (and the lease)
            reader = StateReader(run.ledger)
            held = self._hold(reader)
            _, start = resume_point(run, held)
            why_not = in_place_why_not(run, self.launcher)
            stage.note("recovery_path", in_place=not why_not, why_not=why_not)
            outcome = self._deferred(reader, start + run.spec.training.max_steps).begin()
            result = self._outcome(outcome, start)
        return self._ended(stage, result)

    def resume(self, news: Reported | BackoffOver) -> Deferral | TrainResult:
        """Act on what the task deferred on: the attempt trigger's report, or the end of a backoff.

        The current attempt is the ledger's last one (not a value the deferral
        carried: the ledger is what a retried task sees too). Every wake judges
        the checkpoints written since the last one and renews the run's lease on
        the lineage; if another run took it meanwhile, the attempt ends.
        """
        run = self.run
        reader = StateReader(run.ledger)
        stage = StageRecorder.resumed(run, STAGE, reader.now().stage_start)  # this task's process changes at every wake
        with stage.failures():
            held = self._hold(reader)
            _, start = resume_point(run, held)
            driver = self._deferred(reader, start + run.spec.training.max_steps, start)
            result = self._outcome(driver.resume(news), start)
        return self._ended(stage, result)

    def _hold(self, reader: StateReader) -> lease.Lease:
        """The lineage, renewed; if another run holds it now, end this run's attempt (its pods would run on) and fail."""
        try:
            return hold_lineage(self.run, self.run_state)
        except LineageBusy as exc:
            max_steps = self.run.spec.training.max_steps
            target = reader.now().target_step(max_steps) or max_steps
            self._deferred(reader, target).lost_lease(str(exc))  # ends the attempt, raises
            raise

    def _outcome(self, outcome: Outcome, start: int) -> Deferral | TrainResult:
        if not isinstance(outcome, Done):
            return outcome
        return self._result(start, start + self.run.spec.training.max_steps, outcome.result)

    @staticmethod
    def _ended(stage: StageRecorder, result: Deferral | TrainResult) -> Deferral | TrainResult:
        if isinstance(result, TrainResult):
            stage.end(result)
        return result

    def _result(self, start: int, target: int, result: AttemptResult) -> TrainResult:
        return _trained(self.run, self.nodes, start, target, result)

    def _store(self, target: int) -> CoordinationStore:
        """The coordination stores of this run's in-place attempts. Served by the backend where it can (a pod
        per attempt on Kubernetes: no process of a deferred task stays), else by this process: any node can
        die, the task cannot without ending the attempt anyway; it listens on loopback only (local nodes)."""
        if isinstance(self.launcher, ServesStores):
            run, nodes = self.run, list(self.nodes)

            def plan_for(attempt: int) -> LaunchPlan:  # the attempt's names and keys; its nodes do not matter
                plan = _plan(run, attempt, Course(nodes, run.spec.training.micro_batch, "none"), target)
                return replace(plan, store_keys=store.keys(attempt))

            store = self.launcher.coordination_store(run.dir / "store", self._members(), plan_for, self._refused)
            return store
        return StoreHost.serve(self._members(), on_refused=self._refused)

    def _deferred(self, reader: StateReader, target: int, start: int | None = None) -> Deferred:
        run = self.run
        store = self._store(target) if not in_place_why_not(run, self.launcher) else None
        return Deferred(
            self.launcher,
            reader,
            self._context(elastic=store is not None),
            self._hooks(target, store=store, every_wake=True),
            run.spec.training.heartbeat_timeout_s,
            target,
            on_wake=None if start is None else lambda: watcher(run).carry_on(start).catch_up(),
            startup_grace_s=run.spec.training.startup_grace_s,
            pace=_pace(run),
        )

    def _context(self, elastic: bool = False) -> Context:
        training, spec_nodes = self.run.spec.training, self.run.spec.nodes
        return Context(
            recovery=self.run.spec.recovery,
            nodes=list(self.nodes),
            spares=list(self.spares),
            micro_batch=training.micro_batch,
            global_batch=training.global_batch,
            min_nodes=spec_nodes.min,
            procs_per_node=spec_nodes.procs_per_node,
            reattach=self.launcher.reattaches,
            elastic=elastic,
        )

    def _members(self) -> list[str]:
        """Every node that may take part in an attempt (the store's nodes: each gets a key, no other is read)."""
        return list(dict.fromkeys([*self.nodes, *self.spares]))

    def _refused(self, attempt: int, key: str, why: str) -> None:
        """A value of the coordination store the supervisor refused: evidence in the ledger (it was ignored)."""
        self.run.ledger.append(STAGE, "store_refused", attempt=attempt, key=key, reason=why)

    def _hooks(
        self, target: int, store: CoordinationStore | None = None, every_wake: bool = False,
        catch_up: Callable[[], None] | None = None,
    ) -> Hooks:  # fmt: skip
        """The drivers' hooks; ``every_wake``: a progress line at each wake of a deferred task, which
        sees its attempt only then, instead of every ``training.progress_every_s``; ``catch_up``: judge the
        saves up to now before a decision reads the lineage (the blocking driver's watcher)."""
        run = self.run

        def checkpoints() -> Checkpoints:
            if catch_up is not None:
                catch_up()
            return hot_checkpoints(run)

        return Hooks(
            plan_for=lambda attempt, course: _plan(run, attempt, course, target, store),
            rollback_to=lambda step: rollback(run, step),
            checkpoints=checkpoints,
            progress_for=lambda plan: _progress(run, plan, target, 0 if every_wake else None),
            coordinator_for=store.coordinator if store is not None else None,
            store_address=store.reach if store is not None else None,
            drills_for=lambda attempt: _outside_drills(run, attempt) if isinstance(self.launcher, SignalsNodes) else [],
        )


def _outside_drills(run: Run, attempt: int) -> list[FaultDrill]:
    """The attempt's drills the supervisor looks after for a script not known to act out its drills itself
    (``spec.checks.acts_drills``): it acts out kill, hang and slow unless the script says it does, and checks
    that the others were."""
    if acts_drills(run.spec.training.entrypoint):
        return []
    return [_drill(d) for d in run.spec.drills if d.attempt == attempt]


def _drill(d: Drill) -> FaultDrill:
    return FaultDrill(d.fault, d.step, d.node, d.factor, d.attempt)


def _pace(run: Run) -> Pace:
    """How the deferred task's waits are paced: its backend's wake, the spec's progress lines."""
    training = run.spec.training
    return Pace(
        wake_every_s=wake_every_s(run.spec.nodes) or Pace().wake_every_s,
        progress_every_s=training.progress_every_s,
        tokens_per_step=tokens_per_step(training.global_batch, named(training.args)),
        checkpoint_dir=str(run.checkpoint_root),
    )


def _progress(run: Run, plan: LaunchPlan, target: int, every_s: float | None = None) -> ProgressLog:
    """The progress lines of one attempt in the task's log, every ``training.progress_every_s`` (or ``every_s``)."""
    training = run.spec.training
    return ProgressLog(
        training.progress_every_s if every_s is None else every_s,
        time.time(),
        attempt=plan.attempt,
        world_size=plan.world_size,
        target=target,
        tokens_per_step=tokens_per_step(training.global_batch, named(training.args)),
        heartbeat_dir=plan.heartbeat_dir,
        checkpoint_root=run.checkpoint_root,
        # While no rank beats, each node's log is read for its steps (``recovery.logwatch``).
        logs=LogSteps.of(plan, training, lambda fields: run.ledger.append("train", "step", **fields)),
    )


def _trained(run: Run, nodes: list[str], start: int, target: int, result: AttemptResult) -> TrainResult:
    final = final_checkpoint(run)  # the ledger's, in the pipeline's own root: never the pods' LATEST
    figures = recovery_figures(run.ledger)
    run.ledger.append("train", "recovery_figures", **{k: v for k, v in figures.items() if k != "failures"})
    return TrainResult(
        nodes=list(nodes),
        start_step=start,
        target_step=target,
        last_step=result.last_step,
        checkpoint=str(final) if final else None,
        attempts=result.attempt,
    )


def _plan(run: Run, attempt: int, course: Course, target: int, store: CoordinationStore | None = None) -> LaunchPlan:
    training = run.spec.training
    attempt_dir = run.dir / f"attempt-{attempt}"
    # Before its ranks start: they find the chosen save where they wrote it, and resume_args name it.
    command = attempt_command(run, target, _resume_target(run, course))
    return LaunchPlan(
        run_id=run.dir.name,
        attempt=attempt,
        nodes=list(course.nodes),
        procs_per_node=run.spec.nodes.procs_per_node,
        entrypoint=training.entrypoint,
        framework=training.framework,
        args=command.args,
        log_dir=attempt_dir,
        pass_env=tuple(training.pass_env),
        store_keys=store.keys(attempt) if store is not None else {},
        train_env=TrainEnv(
            data_dir=run.hot_dataset_dir,
            checkpoint_dir=run.checkpoint_root,
            max_steps=target,
            resume_from=course.resume_from,
            heartbeat_dir=attempt_dir / "heartbeat",
            events_dir=run.ledger.events_dir,
            run_id=run.run_id,
            pipeline=run.dag_id,
            attempt=attempt,
            global_batch=training.global_batch,
            micro_batch=course.micro_batch,
            checkpoint_every=training.checkpoint_every,
            checkpoint_async=training.checkpoint_async,
            seed=training.seed,
            progress_every_s=training.progress_every_s,
            store=store.address_for(attempt) if store is not None else None,
            # Longer than the supervisor takes to see a hang and kill the silent node (whose closed sockets
            # then fail the survivors' collective at once): the survivors' own timeout is only the backstop.
            collective_timeout_s=2 * training.heartbeat_timeout_s + 5 if store is not None else None,
            # Every script is told its drills: one that acts them out says so; for the others the supervisor
            # acts out kill, hang and slow (``recovery.drills``).
            drills=tuple(_drill(d) for d in run.spec.drills if d.attempt == attempt),
            metrics_otlp=_live_metrics_endpoint(),
            snapshot_dir=snapshot_dir(run),
            snapshot_every=run.spec.recovery.snapshot_every,
        ),
        workdir=command.workdir,
        script_env=command.env,
    )


def snapshot_dir(run: Run) -> Path | None:
    """The run's in-memory snapshot tier (each node's folder below it), where its backend keeps one."""
    root = backend_for(run.spec.nodes).snapshot_root
    if root is None or run.spec.recovery.snapshot_every <= 0:
        return None
    return root / run.dag_id / run.dir.name


def drop_snapshots(run: Run) -> None:
    """The run's snapshots go with its train stage (they are for relaunching its attempts, never checkpoints).

    The ranks write the tier (and could make any level of it a link): it is reached from the operator's
    folder above the backend's root by held descriptors, no link followed (``held``)."""
    tier = snapshot_dir(run)
    if tier is None:
        return
    root = tier.parent.parent.parent  # /dev/shm for /dev/shm/trainyard/<dag>/<run>
    try:
        top = held.open_root(root)
    except OSError:
        return
    try:
        parent = held.descend(top, [tier.parent.parent.name, tier.parent.name])
    except (OSError, UnsafePath) as exc:  # never made (no snapshot was taken), or a link: nothing of ours there
        if not isinstance(exc, FileNotFoundError):
            log.warning("in-memory snapshots of %s left in place: %s", run.run_id, exc)
        return
    finally:
        os.close(top)
    try:
        held.remove_tree(parent, tier.name)
    finally:
        os.close(parent)


def _resume_target(run: Run, course: Course) -> str | None:
    """What ``{{ resume_from }}`` names for this attempt: the checkpoint it resumes from as the script's own file
    at its own place, put back there first (``checkpoint.putback``); None when it starts fresh, and gets no
    ``resume_args``."""
    ckpt = lineage.resume_checkpoint(run, course.resume_from)
    return str(putback.put_back(run.checkpoint_root, ckpt)) if ckpt is not None else None


def _live_metrics_endpoint() -> str | None:
    """Where rank 0 pushes live training metrics: the collector this worker's OpenTelemetry settings name."""
    try:
        return otlp_endpoint(os.environ)
    except ValueError as exc:  # metrics are not worth a failed run: the task log says why there are none
        log.warning("no live training metrics: %s", exc)
        return None

"""The train stage: plan each attempt, supervise it (blocking) or defer on it, recover until done."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from trainyard.backends.base import Launcher, LaunchPlan, RegroupingLauncher
from trainyard.backends.local.launcher import LocalLauncher
from trainyard.checkpoint import lease, registry
from trainyard.errors import LineageBusy
from trainyard.pipeline.burnin import require_local
from trainyard.pipeline.lineage import hold_lineage, hot_checkpoints, resume_point, rollback, watcher
from trainyard.pipeline.recorder import recorded, stage_failed
from trainyard.pipeline.run import Run
from trainyard.protocol.coordstore import Coordinator
from trainyard.protocol.env import FaultDrill, TrainEnv
from trainyard.recovery.commands import AttemptResult
from trainyard.recovery.deferred import AttemptWatch, Backoff, Deferred, Done
from trainyard.recovery.figures import recovery_figures
from trainyard.recovery.observations import BackoffOver, Context, Reported
from trainyard.recovery.progress import ProgressLog, tokens_per_step
from trainyard.recovery.state import Course
from trainyard.recovery.storehost import attempt_store, serve
from trainyard.recovery.supervisor import Hooks, StateReader, supervise
from trainyard.spec.checks import REFERENCE_WORKLOAD
from trainyard.storage.boot import ensure_this_boot

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def _cli_args(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        if value is True:
            out.append(f"--{key}")
        elif isinstance(value, list):  # --key v1 v2 (argparse nargs)
            out += [f"--{key}", *map(str, value)]
        elif value is not False:
            out += [f"--{key}", str(value)]
    return out


def _context(
    run: Run, nodes: list[str], spares: list[str] | None, launcher: Launcher, elastic: bool = False
) -> Context:
    training, spec_nodes = run.spec.training, run.spec.nodes
    return Context(
        recovery=run.spec.recovery,
        nodes=list(nodes),
        spares=list(spares or []),
        micro_batch=training.micro_batch,
        global_batch=training.global_batch,
        min_nodes=spec_nodes.min,
        procs_per_node=spec_nodes.procs_per_node,
        reattach=launcher.reattaches,
        elastic=elastic,
    )


def _hooks(run: Run, target: int, progress_every_s: float | None = None, store: TCPStore | None = None) -> Hooks:
    address = f"127.0.0.1:{store.port}" if store is not None else None
    return Hooks(
        plan_for=lambda attempt, course: _plan(run, attempt, course, target, address),
        rollback_to=lambda step: rollback(run, step),
        checkpoints=lambda: hot_checkpoints(run),
        progress_for=lambda plan: _progress(run, plan, target, progress_every_s),
        coordinator_for=(lambda attempt: Coordinator(attempt_store(store, attempt))) if store is not None else None,
    )


def in_place_why_not(run: Run, launcher: Launcher) -> str:
    """Why this run's attempts cannot regroup in place ("" when they can): the runtime, backend and shape."""
    spec = run.spec
    if not spec.recovery.in_place:
        return "recovery.in_place is false"
    if not isinstance(launcher, RegroupingLauncher):
        return f"the {spec.nodes.backend} backend relaunches (its nodes cannot change while an attempt runs)"
    if spec.training.entrypoint != REFERENCE_WORKLOAD:
        return f"training.entrypoint {spec.training.entrypoint} is not trainyard's runtime ({REFERENCE_WORKLOAD})"
    if spec.nodes.procs_per_node != 1 or spec.nodes.gpus_per_node:
        return "in place needs one CPU process per node (nodes.procs_per_node 1, nodes.gpus_per_node 0)"
    return ""


@recorded("train")
def train(
    run: Run,
    nodes: list[str],
    launcher: Launcher | None = None,
    spares: list[str] | None = None,
    run_state: lease.RunState | None = None,
) -> dict[str, Any]:
    """Train on ``nodes`` with torchrun, recovering from failures until done or the policy says stop.

    ``launcher`` is the backend (default: local processes); the caller keeps it
    to end the attempt from outside (a killed task). ``spares`` are healthy
    nodes the pressure test did not pick, for replacing lost ones. A retried
    task carries on from the ledger: attempt numbers, nodes and micro-batch.
    The run holds the lineage throughout, renewing its lease at every poll
    (``run_state``: see ``hold_lineage``); losing it ends the attempt.
    """
    if launcher is None:
        require_local(run)
        launcher = LocalLauncher(run.spec.nodes.gpus_per_node)
    ensure_this_boot(run.hot_dataset_dir, run.ledger, "train")  # a reboot since check_dataset: re-verify first
    training = run.spec.training
    held = hold_lineage(run, run_state)
    _, start = resume_point(run, held)
    target = start + training.max_steps
    why_not = in_place_why_not(run, launcher)
    # The store the ranks regroup on lives here, in the task process: any node can die, this one cannot
    # without ending the attempt anyway.
    store = serve()[0] if not why_not else None
    run.ledger.append("train", "recovery_path", in_place=not why_not, why_not=why_not)
    with watcher(run):
        result = supervise(
            launcher,
            run.ledger,
            _context(run, nodes, spares, launcher, elastic=store is not None),
            _hooks(run, target, store=store),
            training.heartbeat_timeout_s,
            keep_alive=held.keep,
        )
    return _trained(run, nodes, start, target, result)


def _progress(run: Run, plan: LaunchPlan, target: int, every_s: float | None = None) -> ProgressLog:
    """The progress lines of one attempt in the task's log, every ``training.progress_every_s`` (or ``every_s``)."""
    training = run.spec.training
    return ProgressLog(
        training.progress_every_s if every_s is None else every_s,
        time.time(),
        attempt=plan.attempt,
        world_size=plan.world_size,
        target=target,
        tokens_per_step=tokens_per_step(training.global_batch, training.args),
        heartbeat_dir=plan.heartbeat_dir,
        checkpoint_root=run.checkpoint_root,
    )


def _trained(run: Run, nodes: list[str], start: int, target: int, result: AttemptResult) -> dict[str, Any]:
    final = registry.latest(run.checkpoint_root)
    figures = recovery_figures(run.ledger)
    run.ledger.append("train", "recovery_figures", **{k: v for k, v in figures.items() if k != "failures"})
    return {
        "nodes": list(nodes),
        "start_step": start,
        "target_step": target,
        "last_step": result.last_step,
        "checkpoint": str(final) if final else None,
        "attempts": result.attempt,
    }


Deferral = AttemptWatch | Backoff


def start_training(
    run: Run,
    nodes: list[str],
    launcher: Launcher,
    spares: list[str] | None = None,
    run_state: lease.RunState | None = None,
) -> Deferral | dict[str, Any]:
    """Launch the run's next attempt, or re-attach to one an earlier task process left running."""
    run.ledger.append("train", "stage_start")
    return _wake(run, nodes, launcher, spares, None, run_state)


def continue_training(
    run: Run,
    nodes: list[str],
    launcher: Launcher,
    spares: list[str] | None,
    news: Reported | BackoffOver,
    run_state: lease.RunState | None = None,
) -> Deferral | dict[str, Any]:
    """Act on what the task deferred on: the attempt trigger's report, or the end of a backoff.

    The current attempt is the ledger's last one (not a value the deferral
    carried: the ledger is what a retried task sees too). Every wake judges
    the checkpoints written since the last one and renews the run's lease on
    the lineage; if another run took it meanwhile, the attempt ends.
    """
    return _wake(run, nodes, launcher, spares, news, run_state)


def _wake(
    run: Run,
    nodes: list[str],
    launcher: Launcher,
    spares: list[str] | None,
    news: Reported | BackoffOver | None,
    run_state: lease.RunState | None,
) -> Deferral | dict[str, Any]:
    reader = StateReader(run.ledger)
    max_steps = run.spec.training.max_steps
    try:
        if news is None:  # before the launch (and the lease): a reboot since check_dataset?
            ensure_this_boot(run.hot_dataset_dir, run.ledger, "train")
        try:
            held = hold_lineage(run, run_state)
        except LineageBusy as exc:
            target = reader.now().target_step(max_steps) or max_steps
            _deferred(run, nodes, spares, launcher, reader, target).lost_lease(str(exc))  # ends the attempt, raises
            raise
        _, start = resume_point(run, held)
        driver = _deferred(run, nodes, spares, launcher, reader, start + max_steps, start)
        outcome = driver.begin() if news is None else driver.resume(news)
        if not isinstance(outcome, Done):
            return outcome
        trained = _trained(run, nodes, start, start + max_steps, outcome.result)
        run.ledger.append("train", "stage_end", seconds=_train_seconds(reader), result=trained)
        return trained
    except Exception as exc:
        stage_failed(run, "train", exc, _train_seconds(reader))
        raise


def _deferred(
    run: Run,
    nodes: list[str],
    spares: list[str] | None,
    launcher: Launcher,
    reader: StateReader,
    target: int,
    start: int | None = None,
) -> Deferred:
    return Deferred(
        launcher,
        reader,
        _context(run, nodes, spares, launcher),
        _hooks(run, target, progress_every_s=0),
        run.spec.training.heartbeat_timeout_s,
        target,
        on_wake=None if start is None else lambda: watcher(run).carry_on(start).sweep(),
    )


def _train_seconds(reader: StateReader) -> float:
    """Since this task's train stage started: its process changed at every wake-up."""
    began = reader.now().stage_start
    return round(time.time() - began, 3) if began is not None else 0.0


def _plan(run: Run, attempt: int, course: Course, target: int, store: str | None = None) -> LaunchPlan:
    training = run.spec.training
    attempt_dir = run.dir / f"attempt-{attempt}"
    return LaunchPlan(
        run_id=run.dir.name,
        attempt=attempt,
        nodes=list(course.nodes),
        procs_per_node=run.spec.nodes.procs_per_node,
        entrypoint=training.entrypoint,
        args=_cli_args(training.args),
        log_dir=attempt_dir,
        pass_env=tuple(training.pass_env),
        train_env=TrainEnv(
            data_dir=run.hot_dataset_dir,
            checkpoint_dir=run.checkpoint_root,
            max_steps=target,
            resume_from=course.resume_from,
            heartbeat_dir=attempt_dir / "heartbeat",
            events_dir=run.ledger.events_dir,
            run_id=run.run_id,
            attempt=attempt,
            global_batch=training.global_batch,
            micro_batch=course.micro_batch,
            checkpoint_every=training.checkpoint_every,
            checkpoint_async=training.checkpoint_async,
            seed=training.seed,
            progress_every_s=training.progress_every_s,
            store=store,
            # Longer than the supervisor takes to see a hang and kill the silent node (whose closed sockets
            # then fail the survivors' collective at once): the survivors' own timeout is only the backstop.
            collective_timeout_s=2 * training.heartbeat_timeout_s + 5 if store else None,
            drills=tuple(
                FaultDrill(d.fault, d.step, d.node, d.factor, d.attempt)
                for d in run.spec.drills
                if d.attempt == attempt
            ),
        ),
    )

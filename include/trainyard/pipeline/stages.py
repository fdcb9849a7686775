"""The pipeline's stages as plain functions: ``stage(run, ...) -> dict``.

The Airflow layer calls these one task each and passes the returned dicts
between tasks as XComs. Each stage records its start, end and failure in the
run ledger, so the report and SLO figures never depend on task logs.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.backends.base import Launcher, LaunchPlan, RegroupingLauncher
from trainyard.backends.local.launcher import LocalLauncher
from trainyard.burnin.fleet import FLEET_DIR, Fleet, iso, record_verdict
from trainyard.burnin.judge import Judge
from trainyard.burnin.local import run_burn_in
from trainyard.burnin.protocol import BurnInRun, drills_from
from trainyard.burnin.verdict import Verdict, format_table, rules_of
from trainyard.checkpoint import cold as cold_copies
from trainyard.checkpoint import lease, registry
from trainyard.checkpoint.format import (
    latest_valid,
    list_checkpoints,
    read_manifest,
    step_dir,
    step_of,
    supersede,
    verify,
)
from trainyard.checkpoint.validate import Validation, inspector, validate
from trainyard.errors import CheckpointInvalid, LineageBusy, NodeUnhealthy, SpecError
from trainyard.events.ledger import safe_name
from trainyard.pipeline.run import Run, check_resume
from trainyard.protocol.coordstore import Coordinator
from trainyard.protocol.env import FaultDrill, TrainEnv
from trainyard.protocol.steps import loss_points
from trainyard.quality.dataset import check_dataset as _check_dataset
from trainyard.quality.metrics import check_metrics
from trainyard.recovery.controller import AttemptResult, BackoffOver, Checkpoints, Context, Course, Reported
from trainyard.recovery.deferred import AttemptWatch, Backoff, Deferred, Done
from trainyard.recovery.figures import recovery_figures
from trainyard.recovery.progress import ProgressLog, tokens_per_step
from trainyard.recovery.storehost import attempt_store, serve
from trainyard.recovery.supervisor import Hooks, StateReader, supervise
from trainyard.report.summary import write_report
from trainyard.spec import KubernetesSpec, Lifecycle, dataset_name_problems
from trainyard.spec.checks import REFERENCE_WORKLOAD
from trainyard.storage import S3Tier, Tier
from trainyard.storage.boot import ensure_this_boot
from trainyard.storage.hot import HotRoom, unpin
from trainyard.storage.staging import stage

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)


def recorded(name: str) -> Callable[[Callable[..., dict[str, Any]]], Callable[..., dict[str, Any]]]:
    """Record the stage's start, end (with seconds and result) or failure in the run's ledger."""

    def wrap(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        def run_stage(run: Run, *args: Any, **kwargs: Any) -> dict[str, Any]:
            started = time.monotonic()
            run.ledger.append(name, "stage_start")
            try:
                result = fn(run, *args, **kwargs)
            except Exception as exc:
                _stage_failed(run, name, exc, time.monotonic() - started)
                raise
            run.ledger.append(name, "stage_end", seconds=round(time.monotonic() - started, 3), result=result)
            return result

        run_stage.__name__ = fn.__name__
        run_stage.__doc__ = fn.__doc__
        return run_stage

    return wrap


def _stage_failed(run: Run, name: str, exc: Exception, seconds: float) -> None:
    run.ledger.append(
        name, "stage_failed", error=type(exc).__name__, message=str(exc)[:2000], seconds=round(seconds, 3)
    )


@recorded("stage_dataset")
def stage_dataset(run: Run) -> dict[str, Any]:
    """Copy the cold shards to the hot tier, verified; only what changed is copied."""
    ds = run.spec.dataset
    # The spec check saw the template; this sees what it rendered to (e.g. a run id with a '/').
    if problems := dataset_name_problems(run.resolve("dataset.name", ds.name), ds.name):
        raise SpecError([f"{run.spec_path}: dataset.name: {p}" for p in problems])
    source = run.tier(run.source_uri, ds.connection)
    if ds.lifecycle:
        _set_lifecycle(source, ds.lifecycle, f"trainyard-{run.dag_id}-data")
    capacity = int(ds.hot_capacity_gb * 1e9) if ds.hot_capacity_gb else None
    room = HotRoom(run.hot_root, capacity, run.holder)
    return stage(source, run.hot_dataset_dir, ledger=run.ledger, concurrency=ds.concurrency, room=room).as_dict()


def _set_lifecycle(tier: Tier, rule: Lifecycle, rule_id: str) -> None:
    # The spec check guarantees an s3:// URI wherever a lifecycle rule is set.
    assert isinstance(tier, S3Tier), tier
    tier.set_lifecycle(safe_name(rule_id), rule.expire_days, rule.transition_days, rule.storage_class)


@recorded("check_dataset")
def check_dataset(run: Run) -> dict[str, Any]:
    """Fail fast (``DataError``) unless the staged shards meet the spec's expectations."""
    ensure_this_boot(run.hot_dataset_dir, run.ledger, "check_dataset")  # staged unsynced in an earlier boot?
    report = _check_dataset(run.hot_dataset_dir, run.spec.dataset.expectations, result_dir=run.dir).as_dict()
    run.ledger.append("check_dataset", "dataset_checked", **report)
    return report


def candidates(run: Run) -> list[str]:
    return [f"node-{i}" for i in range(run.spec.nodes.count + run.spec.nodes.spare)]


@recorded("burn_in")
def burn_in(run: Run, cluster: Any | None = None) -> dict[str, Any]:
    """Pressure-test every candidate node and keep the best ``nodes.count`` healthy ones.

    ``cluster`` is a ``kubernetes`` API client, needed with the kubernetes backend:
    candidates are then cluster nodes, and the evicted ones are marked there.
    A node evicted earlier sits out ``cooldown_h``, then is re-tested here and
    re-admitted when it passes. Every outcome goes into the fleet history.
    """
    cfg, nodes = run.spec.pressure_test, run.spec.nodes
    if not cfg.enabled:  # untested nodes; on Kubernetes still real ones, the hosts the pods are pinned to
        names = _cluster_candidates(run, cluster)[1] if nodes.backend == "kubernetes" else candidates(run)
        return {"healthy": names[: nodes.count], "spare": names[nodes.count :], "skipped": True}
    fleet, now, cooldown_s = Fleet(run.hot_root / FLEET_DIR), time.time(), cfg.cooldown_h * 3600
    drills = drills_from(cfg)
    if nodes.backend == "kubernetes":
        from trainyard.backends.kubernetes.cooldown import due_for_retest
        from trainyard.backends.kubernetes.kinds import node_kinds
        from trainyard.burnin.kubernetes import run_burn_in_k8s  # the kubernetes SDK: only for this backend

        core, names = _cluster_candidates(run, cluster)
        kube = _kube(run)
        retest = due_for_retest(core, kube, cooldown_s, datetime.fromtimestamp(now, UTC))
        names = [*names, *(n for n in retest if n not in names)]
        judge = Judge(
            rules_of(cfg), nodes.count, (kinds := node_kinds(core, names)), fleet.references(kinds.values()), False
        )
        probed = run_burn_in_k8s(
            core,
            names,
            cfg,
            kube,
            run.dir.name,
            str(run.hot_root / ".burnin"),
            drills,
            kube.store_host or socket.gethostbyname(socket.gethostname()),
            judge.recheck,
        )
    else:
        everyone = candidates(run)
        sitting_out = fleet.cooling(everyone, now, cooldown_s)
        for node, until in sitting_out.items():
            log.info("%s sits out its cool-down until %s (fleet history %s)", node, iso(until), fleet.path(node))
        names = [n for n in everyone if n not in sitting_out]
        retest = fleet.due(names, now, cooldown_s)
        kinds = dict.fromkeys(names, local_kind())
        judge = Judge(rules_of(cfg), nodes.count, kinds, fleet.references(kinds.values()), True)
        if sitting_out:
            run.ledger.append("burn_in", "sitting_out", nodes={n: iso(u) for n, u in sitting_out.items()})
        probed = run_burn_in(
            names, cfg, run.hot_root, run.dir / "burn-in", drills, judge.recheck, gpus_per_node=nodes.gpus_per_node
        )
    verdict = judge.verdict(names, probed)
    table = format_table(verdict, judge.rules)
    log.info("pressure test verdict (%.1f s):\n%s", probed.seconds, table)
    _record_verdict(run, fleet, judge, verdict, probed, now, drills)
    readmitted = [n for n in retest if n not in verdict.evicted]
    if nodes.backend == "kubernetes":
        from trainyard.backends.kubernetes.marks import label_evicted, unlabel

        if verdict.evicted:
            marked = label_evicted(
                core, list(verdict.evicted), kube.evicted_label, kube.evict_with, reasons=verdict.evicted
            )
            run.ledger.append("burn_in", "nodes_marked", nodes=marked, label=kube.evicted_label)
        if readmitted:
            unlabel(core, readmitted, kube.evicted_label)
    if retest:
        run.ledger.append(
            "burn_in", "nodes_retested", readmitted=readmitted, evicted=[n for n in retest if n in verdict.evicted]
        )
    if len(verdict.healthy) < nodes.min:
        raise NodeUnhealthy(f"only {len(verdict.healthy)} healthy node(s), nodes.min is {nodes.min}:\n{table}")
    return {
        "healthy": verdict.healthy,
        "evicted": verdict.evicted,
        "spare": verdict.spare,
        "suspects": verdict.suspects,
        "cleared": verdict.cleared,
        "readmitted": readmitted,
        "references": {k: {p: r.value for p, r in refs.items()} for k, refs in verdict.references.items()},
    }


def _record_verdict(
    run: Run,
    fleet: Fleet,
    judge: Judge,
    verdict: Verdict,
    probed: BurnInRun,
    now: float,
    drills: dict[str, tuple[str, float]],
) -> None:
    """Each node's figures of both rounds and its fate, in the ledger and in the fleet history."""
    for node, f in verdict.figures.items():
        state = verdict.state(node)
        reason = verdict.evicted.get(node, "")
        run.ledger.append(
            "burn_in",
            "node_verdict",
            node=node,
            kind=judge.kinds.get(node, ""),
            figures=f,
            again=verdict.again.get(node),
            beside_reference=verdict.beside.get(node) or None,
            suspect=verdict.suspects.get(node, ""),
            collective=probed.collective.get(node),
            links=probed.links.get(node),
            verdict=state,
            reason=reason,
        )
    record_verdict(fleet, verdict, judge.kinds, at=now, run_id=run.dir.name, drills=drills)
    # One row of references and thresholds for the report: the batch's most common kind's.
    kinds = list(judge.kinds.values())
    refs = verdict.references.get(max(set(kinds), key=kinds.count), {}) if kinds else {}
    run.ledger.append(
        "burn_in",
        "thresholds",
        references=verdict.as_dict()["references"],
        reference_values={p: r.value for p, r in refs.items()},
        thresholds={r.probe: r.threshold(refs[r.probe].value) for r in judge.rules if r.probe in refs},
        suspects=verdict.suspects,
        cleared=verdict.cleared,
        seconds=probed.seconds,
    )


def local_kind() -> str:
    """Local candidates are slices of this host: their history is this host's."""
    return f"local:{socket.gethostname()}"


def _kube(run: Run) -> KubernetesSpec:
    """``nodes.kubernetes`` of a Kubernetes run (the spec's models fill it in whenever the backend is kubernetes)."""
    kube = run.spec.nodes.kubernetes
    if kube is None:
        raise SpecError([f"{run.spec_path}: nodes.kubernetes: missing; the kubernetes backend needs it"])
    return kube


def _cluster_candidates(run: Run, cluster: Any | None) -> tuple[Any, list[str]]:
    from kubernetes import client as k8s

    from trainyard.backends.kubernetes.marks import candidate_nodes

    if cluster is None:
        _require_local(run)
    core = k8s.CoreV1Api(cluster)
    want = run.spec.nodes.count + run.spec.nodes.spare
    names = candidate_nodes(core, _kube(run), want)
    if len(names) < run.spec.nodes.min:
        raise NodeUnhealthy(
            f"the cluster has {len(names)} usable node(s) (node_selector, not evicted); nodes.min is"
            f" {run.spec.nodes.min}"
        )
    return core, names


def _require_local(run: Run) -> None:
    if run.spec.nodes.backend != "local":
        raise SpecError(
            [
                f"{run.spec_path}: nodes.backend: kubernetes needs a launcher from the Airflow layer"
                " (the train task builds one from nodes.kubernetes.connection)"
            ]
        )


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


def lease_ttl(run: Run) -> float:
    """How long the run's claim on its lineage holds unrenewed. A deferred train task renews it only
    when it wakes (at least every ``wake_every_s``), so its lease outlasts two waits."""
    k8s = run.spec.nodes.kubernetes
    if run.spec.nodes.backend == "kubernetes" and k8s is not None and k8s.deferrable:
        return max(lease.LEASE_S, 2 * k8s.wake_every_s + 60)
    return lease.LEASE_S


def hold_lineage(run: Run, run_state: lease.RunState | None = None) -> lease.Lease:
    """Claim the pipeline's checkpoints for this run (``LineageBusy`` while another run holds them).

    The train stage renews the claim while it runs; it lasts until the run's
    report releases it, or lapses ``lease_ttl`` after the last renewal.
    ``run_state`` is Airflow's word on the holder's run (the Airflow layer passes it).
    """
    return lease.hold(run.checkpoint_root, run.dag_id, run.run_id, run.ledger, lease_ttl(run), run_state)


def resume_point(run: Run, held: lease.Lease | None = None) -> tuple[str, int]:
    """The checkpoint this run starts from (``none`` or a path) and its step.

    Decided once per run, while the run holds the lineage (``held``), and
    kept in the ledger, so a retried train task aims at the same final step
    instead of training ``max_steps`` more.
    """
    first = next(run.ledger.events("train", "resume_point"), None)
    if first:
        return first["resume_from"], first["start_step"]
    held = held or hold_lineage(run)
    check_resume(run)  # open_run checked it too; the pinned spec lives in a folder pods can write
    choice = run.spec.training.resume_from
    path = latest_valid(run.checkpoint_root) if choice == "latest" else None  # latest_valid verified its choice
    if choice not in ("latest", "none"):
        path = Path(choice)
        if problems := verify(path):
            raise CheckpointInvalid(f"cannot resume from {path}: " + "; ".join(problems))
    start = read_manifest(path)["step"] if path else 0
    resume_from = str(path) if path else "none"
    held.renew()  # verifying can take long: still ours before the pointer moves
    registry.reset(run.checkpoint_root, path, run.ledger)  # the lineage this run extends
    run.ledger.append("train", "resume_point", resume_from=resume_from, start_step=start)
    return resume_from, start


def loss_history(run: Run) -> list[tuple[int, float]]:
    """(step, loss) of this run from the ledger; a retried step's latest value wins.

    Exact at every checkpoint step and divergence; a summarised stretch adds its end and its peak
    (``trainyard.protocol.steps.loss_points``).
    """
    return loss_points(run.ledger.events("train", "step"))


def _validator(run: Run) -> Callable[[Path, int | None], Validation]:
    def check(path: Path, after_step: int | None) -> Validation:
        return validate(path, run.spec.checkpoint.expectations, loss_history(run), after_step)

    return check


def _to_cold(run: Run) -> Callable[[Path], None] | None:
    """During training, copy every valid checkpoint whose step is a multiple of ``cold_every_steps``."""
    every = run.spec.checkpoint.cold_every_steps
    if every is None:
        return None

    def upload(ckpt: Path) -> None:
        if (step_of(ckpt) or 0) % every == 0:
            cold = run.tier(run.cold_checkpoint_uri, run.spec.checkpoint.connection)
            copy = cold_copies.upload_copy(ckpt, cold)  # a prefix of its own; only publish moves the pointer
            run.ledger.append(
                "train",
                "checkpoint_tiered",
                path=str(ckpt),
                uri=f"{run.cold_checkpoint_uri}/{copy.name}",
                bytes=copy.bytes,
            )

    return upload


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
        rollback_to=lambda step: _rollback(run, step),
        checkpoints=lambda: _checkpoints(run),
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
        _require_local(run)
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
    with _watcher(run):
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


def _watcher(run: Run) -> registry.Watcher:
    cfg = run.spec.checkpoint
    inspector().start()  # its torch import runs while training starts, not when the first checkpoint waits
    return registry.Watcher(run.checkpoint_root, _validator(run), run.ledger, cfg.keep_hot, _to_cold(run))


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


# The deferred train task: the controller's commands cut at each wait (``recovery.deferred``), so that
# no process holds a worker slot while an attempt runs or a backoff passes. ``start_training`` and each
# ``continue_training`` is one wake-up in a new process; each returns what to wait for next (an
# ``AttemptWatch`` for the attempt trigger, a ``Backoff`` for a time trigger) or the result.

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
        _stage_failed(run, "train", exc, _train_seconds(reader))
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
        on_wake=None if start is None else lambda: _watcher(run).carry_on(start).sweep(),
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


def _checkpoints(run: Run) -> Checkpoints:
    """The hot checkpoints, for the recovery policy: the valid steps and the lineage's latest."""
    latest = registry.latest(run.checkpoint_root)
    return Checkpoints(
        valid_steps=[step_of(c) or 0 for c in list_checkpoints(run.checkpoint_root) if not verify(c)],
        latest_step=step_of(latest) if latest else None,
    )


def _rollback(run: Run, step: int) -> str:
    """Set the later checkpoints aside (never deleted) and restart the lineage at ``step`` (0: fresh)."""
    for ckpt in list_checkpoints(run.checkpoint_root):
        if (step_of(ckpt) or 0) > step:
            supersede(ckpt)
    target = step_dir(run.checkpoint_root, step) if step else None
    registry.reset(run.checkpoint_root, target, run.ledger)
    run.ledger.append("train", "rolled_back", to_step=step, path=str(target) if target else None)
    return str(target) if target else "none"


@recorded("check_checkpoint")
def check_checkpoint(run: Run, checkpoint: str | None, target_step: int) -> dict[str, Any]:
    """The gate: the run's final checkpoint is whole, loadable, finite, at the final step, and its
    loss history passes the metric expectations (great-expectations; result saved in the run folder)."""
    lease.renew_held(run.checkpoint_root, run.run_id, lease_ttl(run))  # the run's lineage until its report
    if not checkpoint:
        raise CheckpointInvalid(f"no valid checkpoint under {run.checkpoint_root}")
    expect, history = run.spec.checkpoint.expectations, loss_history(run)
    result = validate(Path(checkpoint), expect, history)
    problems = list(result.problems)
    if result.step is not None and result.step != target_step:
        problems.append(f"step {result.step} is not the run's final step {target_step}")
    if result.step is not None:
        problems += [p for p in check_metrics(history, result.step, expect, run.dir) if p not in problems]
    run.ledger.append(
        "check_checkpoint",
        "checkpoint_checked",
        path=checkpoint,
        valid=not problems,
        problems=problems,
        seconds=result.seconds,
    )
    if problems:
        raise CheckpointInvalid(f"{checkpoint}: " + "; ".join(problems))
    return {
        "checkpoint": checkpoint,
        "step": result.step,
        "metrics": read_manifest(Path(checkpoint)).get("metrics", {}),
    }


@recorded("publish")
def publish(run: Run, checkpoint: str) -> dict[str, Any]:
    """Copy the valid checkpoint to a cold-tier prefix of its own, verify the copy, then point ``PUBLISHED`` at it.

    ``uri`` names the copy itself, which is never written again (what downstream DAGs read);
    ``pointer`` names the object that always leads to the latest published copy.
    """
    src = Path(checkpoint)
    lease.renew_held(run.checkpoint_root, run.run_id, lease_ttl(run))  # retention must not take src meanwhile
    cold = run.tier(run.cold_checkpoint_uri, run.spec.checkpoint.connection)
    if run.spec.checkpoint.lifecycle:
        _set_lifecycle(cold, run.spec.checkpoint.lifecycle, f"trainyard-{run.dag_id}-checkpoints")
    keep = lease.keeper(run.checkpoint_root, run.run_id, lease_ttl(run))  # an upload may outlast the lease
    copy = cold_copies.publish(src, cold, run.run_id, on_file=keep)
    uri, pointer = f"{run.cold_checkpoint_uri}/{copy.name}", f"{run.cold_checkpoint_uri}/{cold_copies.POINTER}"
    run.ledger.append("publish", "published", uri=uri, pointer=pointer, step=copy.step, bytes=copy.bytes)
    return {"uri": uri, "pointer": pointer, "step": copy.step, "bytes": copy.bytes}


@recorded("report")
def report(run: Run) -> dict[str, Any]:
    """Write the run's summary and HTML report from its ledger; release the run's hot data and checkpoints."""
    unpin(run.hot_dataset_dir, run.holder)
    lease.release(run.checkpoint_root, run.run_id)
    return write_report(run.dir, run.ledger)

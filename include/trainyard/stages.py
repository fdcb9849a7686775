"""The pipeline's stages as plain functions: ``stage(run, ...) -> dict``.

The Airflow layer calls these one task each and passes the returned dicts
between tasks as XComs. Each stage records its start, end and failure in the
run ledger, so the report and SLO figures never depend on task logs.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.burnin.local import run_burn_in
from trainyard.burnin.protocol import drills_from
from trainyard.burnin.verdict import Rule, decide, format_table
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
from trainyard.checkpoint.resume import check_resume
from trainyard.checkpoint.validate import Validation, inspector, validate
from trainyard.errors import CheckpointInvalid, LineageBusy, NodeUnhealthy, SpecError, TransientError
from trainyard.kube.status import status_from_dicts
from trainyard.launch.base import AttemptStatus, Launcher, LaunchPlan
from trainyard.launch.local import LocalLauncher
from trainyard.ledger import safe_name
from trainyard.quality.dataset import check_dataset as _check_dataset
from trainyard.quality.metrics import check_metrics
from trainyard.recovery.figures import recovery_figures
from trainyard.recovery.policy import Situation
from trainyard.recovery.progress import ProgressLog, tokens_per_step
from trainyard.recovery.supervisor import (
    AttemptResult,
    Course,
    attempt_failed,
    attempt_succeeded,
    detect,
    pause,
    recover,
    start_attempt,
    supervise,
)
from trainyard.report.summary import write_report
from trainyard.run import Run
from trainyard.spec import PROBES, Lifecycle, dataset_name_problems
from trainyard.storage import S3Tier, Tier
from trainyard.storage.hot import HotRoom, unpin
from trainyard.storage.staging import stage
from trainyard.train.drills import ENV as DRILLS_ENV
from trainyard.train.progress import loss_points

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
    """
    cfg, nodes = run.spec.pressure_test, run.spec.nodes
    if not cfg.enabled:  # untested nodes; on Kubernetes still real ones, the hosts the pods are pinned to
        names = _cluster_candidates(run, cluster)[1] if nodes.backend == "kubernetes" else candidates(run)
        return {"healthy": names[: nodes.count], "skipped": True}
    if nodes.backend == "kubernetes":
        from trainyard.burnin.kubernetes import run_burn_in_k8s  # the kubernetes SDK: only for this backend

        core, names = _cluster_candidates(run, cluster)
        probed = run_burn_in_k8s(
            core,
            names,
            cfg,
            nodes.kubernetes,
            run.dir.name,
            str(run.hot_root / ".burnin"),
            drills_from(cfg),
            nodes.kubernetes.store_host or socket.gethostbyname(socket.gethostname()),
        )
    else:
        names = candidates(run)
        probed = run_burn_in(names, cfg, run.hot_root, run.dir / "burn-in", drills_from(cfg))
    rules = [Rule(p, cfg.floor(p), cfg.ratio(p)) for p in PROBES]
    figures = {n: probed.local.get(n) for n in names}
    verdict = decide(figures, nodes.count, rules, probed.dead)
    table = format_table(verdict, rules)
    log.info("pressure test verdict (%.1f s):\n%s", probed.seconds, table)
    for node, f in figures.items():
        run.ledger.append(
            "burn_in",
            "node_verdict",
            node=node,
            figures=f,
            collective=probed.collective.get(node),
            verdict="train" if node in verdict.healthy else "spare" if node in verdict.spare else "evicted",
            reason=verdict.evicted.get(node, ""),
        )
    run.ledger.append(
        "burn_in", "thresholds", medians=verdict.medians, thresholds=verdict.thresholds, seconds=probed.seconds
    )
    if nodes.backend == "kubernetes" and verdict.evicted:
        from trainyard.kube.marks import label_evicted

        marked = label_evicted(core, list(verdict.evicted), nodes.kubernetes.evicted_label, nodes.kubernetes.evict_with)
        run.ledger.append("burn_in", "nodes_marked", nodes=marked, label=nodes.kubernetes.evicted_label)
    if len(verdict.healthy) < nodes.min:
        raise NodeUnhealthy(f"only {len(verdict.healthy)} healthy node(s), nodes.min is {nodes.min}:\n{table}")
    return {"healthy": verdict.healthy, "evicted": verdict.evicted, "spare": verdict.spare, "medians": verdict.medians}


def _cluster_candidates(run: Run, cluster: Any | None) -> tuple[Any, list[str]]:
    from kubernetes import client as k8s

    from trainyard.kube.marks import candidate_nodes

    if cluster is None:
        _require_local(run)
    core = k8s.CoreV1Api(cluster)
    want = run.spec.nodes.count + run.spec.nodes.spare
    names = candidate_nodes(core, run.spec.nodes.kubernetes, want)
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
    path = latest_valid(run.checkpoint_root) if choice == "latest" else None if choice == "none" else Path(choice)
    if choice not in ("latest", "none") and (problems := verify(path)):  # latest_valid verified its own choice
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
    (``trainyard.train.progress.loss_points``).
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
        launcher = LocalLauncher()
    training = run.spec.training
    held = hold_lineage(run, run_state)
    resume_from, start = resume_point(run, held)
    target = start + training.max_steps
    course, first = _course(run, nodes, resume_from)
    with _watcher(run):
        result = supervise(
            launcher,
            lambda attempt, c: _plan(run, attempt, c, target),
            course,
            _spares_left(run, spares),
            lambda c, free: _situation(run, c, free),
            run.spec.recovery,
            run.ledger,
            training.heartbeat_timeout_s,
            lambda step: _rollback(run, step),
            first_attempt=first,
            progress_for=lambda plan: _progress(run, plan, target),
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
        heartbeat_dir=Path(plan.env["TRAINYARD_HEARTBEAT_DIR"]),
        checkpoint_root=run.checkpoint_root,
    )


def _watcher(run: Run) -> registry.Watcher:
    cfg = run.spec.checkpoint
    inspector().start()  # its torch import runs while training starts, not when the first checkpoint waits
    return registry.Watcher(run.checkpoint_root, _validator(run), run.ledger, cfg.keep_hot, _to_cold(run))


def _spares_left(run: Run, spares: list[str] | None) -> list[str]:
    """Burn-in's spares minus those an earlier attempt of this run already took (a retried task)."""
    used = {node for e in run.ledger.events("train", "attempt_start") for node in e["nodes"]}
    return [node for node in spares or [] if node not in used]


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


# The deferred train task: the same attempts, decisions and ledger as ``train``, cut at each wait so
# that no process holds a worker slot while an attempt runs. ``start_training`` launches and returns
# a *watch* (what a trigger needs); the task defers, and each event of the trigger comes back to
# ``continue_training``, which returns the next watch or the result. Each half runs in a new process,
# so everything it needs is in the ledger or the watch.


def start_training(
    run: Run, nodes: list[str], launcher: Any, spares: list[str] | None = None, run_state: lease.RunState | None = None
) -> dict[str, Any]:
    """Launch the run's next attempt, or re-attach to one an earlier task process left running; the watch."""
    run.ledger.append("train", "stage_start")
    try:
        held = _hold_or_end(run, launcher, run_state)
        resume_from, start = resume_point(run, held)
        target = start + run.spec.training.max_steps
        if _unfinished_attempt(run) is not None:
            _, plan, _, watch = _current(run, launcher, target)
            log.info("attempt %d is still running; watching it again", plan.attempt)
            return watch
        course, first = _course(run, nodes, resume_from)
        return _launch(run, launcher, first, course, target)
    except Exception as exc:
        _stage_failed(run, "train", exc, _train_seconds(run))
        raise


def continue_training(
    run: Run,
    nodes: list[str],
    launcher: Any,
    spares: list[str] | None,
    event: dict[str, Any],
    run_state: lease.RunState | None = None,
) -> dict[str, Any]:
    """Act on the trigger's ``event`` for the current attempt: ``{"watch": ...}`` to wait again, or ``{"result": ...}``.

    The current attempt is the ledger's last one (not a value the deferral
    carried: the ledger is what a retried task sees too). Every wake judges
    the checkpoints written since the last one. A failure is classified and
    decided as in ``train``; unless the policy says fail (``TrainingFailed``),
    the next attempt is launched and watched. Every wake renews the run's
    lease on the lineage; if another run took it meanwhile, the attempt ends.
    """
    try:
        held = _hold_or_end(run, launcher, run_state)
        _, start = resume_point(run, held)
        target = start + run.spec.training.max_steps
        course, plan, handle, watch = _current(run, launcher, target)
        run.ledger.append(
            "train", "attempt_event", attempt=plan.attempt, status=event["status"], message=event.get("message", "")
        )
        # Look first, then judge the checkpoints: an attempt seen finished has its last one on disk.
        status = launcher.poll(handle) if event["status"] not in ("succeeded", "error") else None
        _watcher(run).carry_on(start).sweep()
        beats = Path(plan.env["TRAINYARD_HEARTBEAT_DIR"])
        if event["status"] == "error":
            # The cluster did not answer; the attempt may well be running. A retried task re-attaches.
            raise TransientError(f"lost sight of attempt {plan.attempt}: {event['message']}")
        problem = _problem(run, status, plan, watch, event) if status is not None else None
        if problem == "running":
            # A wake-up with nothing wrong: wait on. The task's own log gets a progress line per wake, since
            # the triggerer starts a new log file for each trigger and the earlier lines leave the UI's view.
            log.info("%s", _progress(run, plan, target, every_s=0).poll(time.time()))
            return {"watch": watch}
        launcher.cancel(handle)
        if problem is None:
            result = attempt_succeeded(plan, watch["started"], beats, run.ledger)
            trained = _trained(run, nodes, start, target, result)
            run.ledger.append("train", "stage_end", seconds=_train_seconds(run), result=trained)
            return {"result": trained}
        failed = attempt_failed(plan, problem[0], run.ledger, beats, *problem[1])
        course, delay = recover(
            launcher,
            failed,
            course,
            _spares_left(run, spares),
            lambda c, free: _situation(run, c, free),
            run.spec.recovery,
            run.ledger,
            lambda step: _rollback(run, step),
        )
        pause(delay, held.keep)
        return {"watch": _launch(run, launcher, plan.attempt + 1, course, target)}
    except Exception as exc:
        _stage_failed(run, "train", exc, _train_seconds(run))
        raise


def _hold_or_end(run: Run, launcher: Any, run_state: lease.RunState | None) -> lease.Lease:
    """Claim the lineage again at each deferred wake; if another run holds it now, end this run's attempt
    (its pods run on without a task process) before failing."""
    try:
        return hold_lineage(run, run_state)
    except LineageBusy:
        first = next(run.ledger.events("train", "resume_point"), None)
        if first and _unfinished_attempt(run) is not None:
            launcher.cancel(_current(run, launcher, first["start_step"] + run.spec.training.max_steps)[2])
        raise


def _problem(
    run: Run, status: AttemptStatus, plan: LaunchPlan, watch: dict[str, Any], event: dict[str, Any]
) -> tuple[AttemptStatus, tuple[str, list[str], str]] | str | None:
    """What a non-success event means, judged on a fresh look (``status``, with the pods' logs as evidence):
    the status and ``(trigger, suspects, reason)`` of a failure, ``None`` if it succeeded, or ``"running"``."""
    if event["status"] == "hang":
        return status, ("hang", list(event.get("suspects", [])), event["message"])
    beats = Path(plan.env["TRAINYARD_HEARTBEAT_DIR"])
    problem = detect(status, beats, plan.world_size, watch["started"], run.spec.training.heartbeat_timeout_s)
    if problem:
        return status, problem
    if event["status"] == "failed":  # the pods went before this look: the trigger's record is the evidence
        return status_from_dicts(event["nodes"]), ("crash", [], event["message"])
    return None if status.state == "succeeded" else "running"


def _launch(run: Run, launcher: Any, attempt: int, course: Course, target: int) -> dict[str, Any]:
    plan = _plan(run, attempt, course, target)
    start_attempt(launcher, plan, run.ledger)
    return _current(run, launcher, target)[3]


def _current(run: Run, launcher: Any, target: int) -> tuple[Course, LaunchPlan, Any, dict[str, Any]]:
    """The ledger's last attempt: its course, plan (rebuilt exactly: plans are pure), handle and watch.

    The watch is what the trigger needs, JSON-safe: it travels through the metadata DB.
    """
    last = list(run.ledger.events("train", "attempt_start"))[-1]
    course = _attempt_course(last)
    plan = _plan(run, last["attempt"], course, target)
    handle = launcher.attach(plan)
    watch = {
        "attempt": plan.attempt,
        "started": last["ts"],
        "namespace": handle.namespace,
        "job_name": handle.name,
        "nodes": list(plan.nodes),
        "world_size": plan.world_size,
        "heartbeat_dir": plan.env["TRAINYARD_HEARTBEAT_DIR"],
        "target_step": target,
    }
    return course, plan, handle, watch


def _unfinished_attempt(run: Run) -> dict[str, Any] | None:
    """The last attempt_start without an attempt_end: launched by a task process that then died."""
    starts = list(run.ledger.events("train", "attempt_start"))
    ended = {e["attempt"] for e in run.ledger.events("train", "attempt_end")}
    return starts[-1] if starts and starts[-1]["attempt"] not in ended else None


def _attempt_course(start: dict[str, Any]) -> Course:
    return Course(list(start["nodes"]), int(start["micro_batch"]), start["resume_from"])


def _train_seconds(run: Run) -> float:
    """Since this task's train stage started: its process changed at every wake-up."""
    starts = [e["ts"] for e in run.ledger.events("train", "stage_start")]
    return round(time.time() - starts[-1], 3) if starts else 0.0


def _course(run: Run, nodes: list[str], resume_from: str) -> tuple[Course, int]:
    """Where a (possibly retried) train task starts: the first attempt, or after the last one in the ledger."""
    starts = list(run.ledger.events("train", "attempt_start"))
    if not starts:
        return Course(list(nodes), run.spec.training.micro_batch, resume_from), 1
    last = starts[-1]
    decision = next(
        (e for e in reversed(list(run.ledger.events("train", "decision"))) if e["attempt"] == last["attempt"]), {}
    )
    course = Course(
        decision.get("new_nodes", last["nodes"]),
        int(decision.get("micro_batch") or last["micro_batch"] or run.spec.training.micro_batch),
        "latest",
    )
    return course, last["attempt"] + 1


def _plan(run: Run, attempt: int, course: Course, target: int) -> LaunchPlan:
    training = run.spec.training
    attempt_dir = run.dir / f"attempt-{attempt}"
    drills = [d.model_dump() for d in run.spec.drills if d.attempt == attempt]
    return LaunchPlan(
        run_id=run.dir.name,
        attempt=attempt,
        nodes=list(course.nodes),
        procs_per_node=run.spec.nodes.procs_per_node,
        entrypoint=training.entrypoint,
        args=_cli_args(training.args),
        log_dir=attempt_dir,
        pass_env=tuple(training.pass_env),
        env={
            "TRAINYARD_DATA_DIR": str(run.hot_dataset_dir),
            "TRAINYARD_CHECKPOINT_DIR": str(run.checkpoint_root),
            "TRAINYARD_RESUME_FROM": course.resume_from,
            "TRAINYARD_HEARTBEAT_DIR": str(attempt_dir / "heartbeat"),
            "TRAINYARD_LEDGER": str(run.ledger.path),
            "TRAINYARD_RUN_ID": run.run_id,
            "TRAINYARD_ATTEMPT": str(attempt),
            "TRAINYARD_MAX_STEPS": str(target),
            "TRAINYARD_GLOBAL_BATCH": str(training.global_batch),
            "TRAINYARD_MICRO_BATCH": str(course.micro_batch),
            "TRAINYARD_CHECKPOINT_EVERY": str(training.checkpoint_every),
            "TRAINYARD_CHECKPOINT_ASYNC": "1" if training.checkpoint_async else "0",
            "TRAINYARD_SEED": str(training.seed),
            "TRAINYARD_PROGRESS_EVERY_S": str(training.progress_every_s),
            **({DRILLS_ENV: json.dumps(drills)} if drills else {}),
        },
    )


def _situation(run: Run, course: Course, spares: list[str]) -> Situation:
    latest = registry.latest(run.checkpoint_root)
    started = course.resume_from if course.resume_from not in ("latest", "none") else str(latest) if latest else None
    return Situation(
        nodes=list(course.nodes),
        spares=list(spares),
        min_nodes=run.spec.nodes.min,
        procs_per_node=run.spec.nodes.procs_per_node,
        global_batch=run.spec.training.global_batch,
        micro_batch=course.micro_batch,
        valid_steps=[step_of(c) or 0 for c in list_checkpoints(run.checkpoint_root) if not verify(c)],
        resumed_from=step_of(Path(started)) if started else None,
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

"""The pipeline's checkpoint lineage as one run holds it: the lease, the resume point, validation and rollback."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from trainyard.checkpoint import cold as cold_copies
from trainyard.checkpoint import foreign, lease, registry
from trainyard.checkpoint.format import (
    latest_valid,
    list_checkpoints,
    read_manifest,
    step_dir,
    step_of,
    verify,
)
from trainyard.checkpoint.validate import Validation, inspector, validate
from trainyard.errors import CheckpointInvalid
from trainyard.events.fold import TrainRun, fold
from trainyard.pipeline.run import Run, check_resume, wake_every_s
from trainyard.protocol.steps import loss_points
from trainyard.recovery.observations import Checkpoints
from trainyard.text import printable

log = logging.getLogger(__name__)


def lease_ttl(run: Run) -> float:
    """How long the run's claim on its lineage holds unrenewed. A deferred train task renews it only
    when it wakes (at least every ``wake_every_s``), so its lease outlasts two waits."""
    wake = wake_every_s(run.spec.nodes)
    return lease.LEASE_S if wake is None else max(lease.LEASE_S, 2 * wake + 60)


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
    decided = TrainRun.of(run.ledger.events("train"))  # the fold the controller reads: one resume point per run
    if decided.resume_from is not None and decided.start_step is not None:
        return decided.resume_from, decided.start_step
    held = held or hold_lineage(run)
    check_resume(run)  # open_run checked it too; the pinned spec lives in a folder pods can write
    choice = run.spec.training.resume_from
    if choice == "latest":
        adopt_newest(run)  # a framework's newest save (last night's checkpoint-120) becomes the lineage's newest
    path = latest_valid(run.checkpoint_root) if choice == "latest" else None  # latest_valid verified its choice
    if choice not in ("latest", "none"):
        path = Path(choice)
        if problems := verify(path):
            raise CheckpointInvalid(f"cannot resume from {path}: " + "; ".join(problems))
    start = read_manifest(path)["step"] if path else 0
    resume_from = str(path) if path else "none"
    held.renew()  # verifying can take long: still ours before the pointer moves
    # The lineage this run extends; what lies beyond its start belongs to one that ended, and a later
    # "latest" must not resume from it (nor this run's next attempt, nor retention count it as newest).
    moved = registry.set_aside(run.checkpoint_root, path)
    registry.reset(run.checkpoint_root, path, run.ledger, moved)
    run.ledger.append("train", "resume_point", resume_from=resume_from, start_step=start)
    return resume_from, start


def loss_history(run: Run) -> list[tuple[int, float]]:
    """(step, loss) of this run from the ledger; a retried step's latest value wins.

    Exact at every checkpoint step and divergence; a summarised stretch adds its end and its peak
    (``trainyard.protocol.steps.loss_points``).
    """
    return loss_points(TrainRun.of(run.ledger.events("train", "step")).steps)


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


def run_shape(run: Run) -> foreign.RunShape:
    """What an adopted save's manifest records of this run: the latest attempt's (or group's) world size,
    else the spec's nodes x procs; the spec's global and micro batch."""
    worlds = TrainRun.of(run.ledger.events("train")).worlds
    nodes, training = run.spec.nodes, run.spec.training
    world = worlds[-1][1] if worlds else nodes.count * nodes.procs_per_node
    return foreign.RunShape(int(world), training.global_batch, training.micro_batch, run.run_id)


def _lineage_start_ns(run: Run) -> int:
    """When this run decided its resume point: framework saves older than that are not this run's."""
    decided = TrainRun.of(run.ledger.events("train", "resume_point")).resume_decided_at
    return int(decided * 1e9) if decided is not None else 0


def step_reader(run: Run) -> Callable[[Path], int | None]:
    """The sandboxed inspector's step of a save whose name carries none, the spec's ``checkpoint.step_key`` first."""
    key = run.spec.checkpoint.step_key
    return lambda path: inspector().step_of(path, key=key)


def adoption(run: Run, since_ns: int | None = None) -> foreign.Adoption:
    return foreign.Adoption(
        shape=lambda: run_shape(run),
        since_ns=_lineage_start_ns(run) if since_ns is None else since_ns,
        step_reader=step_reader(run),
        save_folder=run.spec.checkpoint.save_folder,
    )


def watcher(run: Run) -> registry.Watcher:
    cfg = run.spec.checkpoint
    inspector().start()  # its torch import runs while training starts, not when the first checkpoint waits
    return registry.Watcher(
        run.checkpoint_root, _validator(run), run.ledger, cfg.keep_hot, _to_cold(run), adoption=adoption(run)
    )


def adopt_newest(run: Run) -> Path | None:
    """Before a resume point is chosen: adopt the newest complete framework save beyond the lineage's newest
    checkpoint (any age: last night's counts) and judge it as the watcher would; the checkpoint if valid.

    An invalid one is quarantined (its reasons in the ledger), so ``latest_valid`` goes further back."""
    root = run.checkpoint_root
    found = foreign.scan(root, run.spec.checkpoint.save_folder)
    chosen = foreign.adoptable(root, found, {}, time.time_ns(), 0, step_reader(run))
    if not chosen:
        return None
    newest = chosen[-1]  # the older ones would only be retired again
    try:
        ckpt = foreign.adopt(root, newest, run_shape(run))
    except (CheckpointInvalid, OSError) as exc:
        log.warning("cannot adopt %s to resume from it: %s", printable(newest.source), printable(exc, 1000))
        return None
    run.ledger.append(
        "train",
        "checkpoint_adopted",
        path=str(ckpt),
        step=newest.step,
        framework=newest.kind,
        source=printable(newest.source),
    )
    judge = registry.Watcher(root, _validator(run), run.ledger, run.spec.checkpoint.keep_hot)
    judge.seen = {c.name for c in list_checkpoints(root)} - {ckpt.name}  # judge only this one
    judge.valid = set()  # nothing else is retired on the way
    judge.sweep()
    return ckpt if ckpt.name in judge.valid else None


def final_sweep(run: Run) -> list[Path]:
    """The gate's last look: adopt the framework saves this run wrote that the train stage's watcher did not
    (written in its last instant, or too fresh then), and judge them; the checkpoints adopted."""
    start = TrainRun.of(run.ledger.events("train")).start_step
    if start is None:
        return []
    inspector().start()
    w = registry.Watcher(
        run.checkpoint_root, _validator(run), run.ledger, run.spec.checkpoint.keep_hot, None, adoption=adoption(run)
    ).carry_on(start)
    made = w.adopt(wait_s=1.0)
    if made:
        w.sweep()
    return made


def hot_checkpoints(run: Run) -> Checkpoints:
    """The hot checkpoints, for the recovery policy: the valid steps and the lineage's latest."""
    latest = registry.latest(run.checkpoint_root)
    return Checkpoints(
        valid_steps=[step_of(c) or 0 for c in list_checkpoints(run.checkpoint_root) if not verify(c)],
        latest_step=step_of(latest) if latest else None,
    )


def final_checkpoint(run: Run) -> Path | None:
    """The run's final checkpoint as the orchestrator recorded it: the lineage's last promotion (or its
    start) in the run's own ledger, through the fold, if that is a checkpoint folder directly in the
    pipeline's root (``registry.in_root``); None otherwise.

    Never ``LATEST``: the run's pods write the folder it lives in, and a pointer to another pipeline's
    checkpoint would have the gate check and publish that one. A pointer that disagrees is a warning and
    a ``pointer_refused`` event: evidence of whoever wrote it.
    """
    root = run.checkpoint_root
    named = fold(run.ledger.events_since(0)[0]).latest_checkpoint  # the orchestrator's own file, no worker's
    final = registry.in_root(root, named) if named else None
    pointed, problem = registry.pointer(root)
    if problem or pointed != final:
        problem = problem or f"{root / registry.LATEST} names {pointed}, not the ledger's {final}; ignored"
        log.warning("final checkpoint %s: %s", final, problem)
        used = str(final) if final else None
        run.ledger.append("train", "pointer_refused", path=str(root / registry.LATEST), problem=problem, used=used)
    return final


def resume_checkpoint(run: Run, chosen: str) -> Path | None:
    """The checkpoint folder an attempt's ``resume_from`` names: ``latest`` is the lineage's last promotion as
    the orchestrator's own ledger records it (never ``LATEST``, which ranks can write); a path only if it is
    a checkpoint folder of this pipeline's root; None for a fresh start."""
    if chosen == "none":
        return None
    named = fold(run.ledger.events_since(0)[0]).latest_checkpoint if chosen == "latest" else chosen
    return registry.in_root(run.checkpoint_root, named) if named else None


def rollback(run: Run, step: int) -> str:
    """Set the later checkpoints aside (never deleted) and restart the lineage at ``step`` (0: fresh)."""
    target = step_dir(run.checkpoint_root, step) if step else None
    registry.reset(run.checkpoint_root, target, run.ledger, registry.set_aside(run.checkpoint_root, target))
    run.ledger.append("train", "rolled_back", to_step=step, path=str(target) if target else None)
    return str(target) if target else "none"


def why_none(run: Run) -> str:
    """The gate's message when the run has no valid checkpoint: what a valid checkpoint is, how to write
    one, and what was found under the root and why it was not taken."""
    root = run.checkpoint_root
    lines = [f"no valid checkpoint under {root}.", foreign.FORMATS_HELP]
    refused = [  # the problems name the rank's files: one printable line each (a newline forges a log line)
        f"{printable(Path(r.path).name)}: " + "; ".join(printable(p, 400) for p in r.problems[:3])
        for r in fold(run.ledger.events_since(0)[0]).checkpoints
        if r.valid is False and r.problems
    ]
    found = foreign.explain(root, run.spec.checkpoint.save_folder)
    if found or refused:
        lines.append("Found: " + " | ".join([*found[:20], *refused[:20]]))
    else:
        lines.append("Found nothing that looks like a checkpoint (did the script save into TRAINYARD_CHECKPOINT_DIR?)")
    return " ".join(lines)

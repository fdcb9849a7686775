"""The checkpoint gate and publishing: the run's final checkpoint checked, then copied to the cold tier."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.atomic import TooLarge
from trainyard.checkpoint import cold as cold_copies
from trainyard.checkpoint import lease, registry
from trainyard.checkpoint.format import manifest_digest, read_manifest
from trainyard.checkpoint.validate import validate
from trainyard.errors import CheckpointInvalid
from trainyard.events.fold import fold
from trainyard.pipeline.data import set_lifecycle
from trainyard.pipeline.lineage import final_checkpoint, final_sweep, lease_ttl, loss_history, why_none
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.results import GateResult, PublishResult
from trainyard.pipeline.run import Run
from trainyard.protocol.heartbeat import HOW_TO_BEAT
from trainyard.quality.metrics import check_metrics
from trainyard.spec import KubernetesSpec

log = logging.getLogger(__name__)


@recorded("check_checkpoint")
def check_checkpoint(
    run: Run, checkpoint: str | None, target_step: int, connect: Callable[[KubernetesSpec], Any] | None = None
) -> GateResult:
    """The gate: the run's final checkpoint is whole, loadable, finite, at the final step, and its
    loss history passes the metric expectations (great-expectations; result saved in the run folder).

    ``connect``: a Kubernetes API client for the spec, to hash the files with a Job of pods where
    ``nodes.kubernetes.verify_pods`` asks (``backends.kubernetes.verify``)."""
    lease.renew_held(run.checkpoint_root, run.run_id, lease_ttl(run))  # the run's lineage until its report
    if final_sweep(run):  # a framework's last save (Hugging Face, Lightning, torch.save, DCP), adopted now
        final = final_checkpoint(run)
        checkpoint = str(final) if final else checkpoint
    if not checkpoint:
        raise CheckpointInvalid(why_none(run))
    if registry.in_root(run.checkpoint_root, checkpoint) is None:  # what publish copies into this pipeline's name
        raise CheckpointInvalid(
            f"{checkpoint} is not a checkpoint folder of this pipeline ({run.checkpoint_root}/step_NNNNNN, not a"
            " link): the gate checks and publishes only the pipeline's own; train again to make one"
        )
    expect, history = run.spec.checkpoint.expectations, loss_history(run)
    digest = _digest(Path(checkpoint))  # before validating: a manifest swapped meanwhile is not the one passed
    result = validate(Path(checkpoint), expect, history, hashed=_in_cluster(run, Path(checkpoint), connect))
    problems = list(result.problems)
    ended_well = fold(run.ledger.events("train")).stages.get("train", {}).get("ok") is True
    if (why := step_problem(result.step, target_step, ended_well)) is not None:
        problems.append(why)
    if not problems and (digest is None or _digest(Path(checkpoint)) != digest):
        problems.append("manifest.json changed while the gate checked it")
    notes = []
    if result.step is not None and history:
        problems += [p for p in check_metrics(history, result.step, expect, run.dir) if p not in problems]
    elif result.step is not None:  # a script that reports no loss at all: nothing to hold the loss to
        notes.append(f"loss expectations not checked: the training script reports no loss; to have them, {HOW_TO_BEAT}")
    short = target_step - result.step if result.step is not None else None
    run.ledger.append(
        "check_checkpoint",
        "checkpoint_checked",
        path=checkpoint,
        valid=not problems,
        problems=problems,
        seconds=result.seconds,
        manifest_sha256=digest,
        **({"notes": notes} if notes else {}),
        step=result.step,
        target_step=target_step,
        steps_short=short,
    )
    for note in notes:
        log.warning("%s", note)
    if not problems:
        log.info("%s", passed_line(Path(checkpoint).name, result.step, target_step))
    if problems:
        raise CheckpointInvalid(f"{checkpoint}: " + "; ".join(problems))
    return GateResult(
        checkpoint=checkpoint, step=result.step, metrics=read_manifest(Path(checkpoint)).get("metrics", {})
    )


def step_problem(step: int | None, target_step: int, ended_well: bool) -> str | None:
    """Why the final checkpoint's step fails the gate (None: it passes). A script that saves every N steps
    leaves its last save short of ``max_steps`` (a save at 180 of 200): that save is the run's final
    checkpoint when the train stage itself ended well; short of it after a failed or unrecorded train stage,
    or beyond the target, it is not."""
    if step is None or step == target_step:
        return None
    if step < target_step and ended_well:
        return None
    if step < target_step:
        return (
            f"step {step} is not the run's final step {target_step} ({target_step - step} short), and the train"
            " stage did not end well: a last save short of max_steps passes only after a train stage that succeeded"
        )
    return f"step {step} is not the run's final step {target_step} (beyond it)"


def passed_line(name: str, step: int | None, target_step: int) -> str:
    """The task log's line of a passed gate: the step passed and how far it is from ``max_steps``."""
    if step is None or step == target_step:
        return f"gate passed {name} at step {step}, the run's final step"
    return (
        f"gate passed {name} at step {step}, {target_step - step} step(s) short of the final step {target_step}"
        " (the script's last save; the train stage ended well)"
    )


def gated(run: Run, checkpoint: str) -> Path:
    """The checkpoint this run's gate passed, as its ledger records it, still with the manifest it passed.

    An XCom is anyone's to write (an evaluation task, a hand-written DAG): a result naming another
    pipeline's checkpoint, or one the gate never saw, must not move ``PUBLISHED``. The gate's event is read
    from the orchestrator's own ledger file (no training process writes it) through the one fold; the
    folder must still be a real checkpoint folder directly in this pipeline's root, and its manifest (which
    lists every file's hash, checked again as the copy is made) the bytes the gate read.
    """
    verdict = fold(run.ledger.events_since(0)[0]).gated
    if verdict is None or not verdict.valid or not verdict.manifest_sha256:
        raise CheckpointInvalid(
            f"{checkpoint}: this run's gate (check_checkpoint) passed no checkpoint; only what it passed is"
            " published: run the gate first"
        )
    if checkpoint != verdict.path:
        raise CheckpointInvalid(
            f"{checkpoint} is not the checkpoint this run's gate passed ({verdict.path}); only that is published"
        )
    src = registry.in_root(run.checkpoint_root, verdict.path)
    if src is None:  # swapped for a link, or not this pipeline's: it would copy wherever it leads
        raise CheckpointInvalid(
            f"{verdict.path} is not a checkpoint folder of this pipeline now ({run.checkpoint_root}/step_NNNNNN,"
            " not a link); only the checkpoint folder the gate passed is published"
        )
    if _digest(src) != verdict.manifest_sha256:
        raise CheckpointInvalid(f"{src}: manifest.json changed since the gate passed it; run the gate again")
    return src


def _digest(checkpoint: Path) -> str | None:
    """The manifest's digest; None where it cannot be read (gone, a link, a FIFO, gigabytes: validation says
    which), which matches no recorded digest."""
    try:
        return manifest_digest(checkpoint)
    except (OSError, TooLarge):
        return None


def _in_cluster(run: Run, checkpoint: Path, connect: Callable[[KubernetesSpec], Any] | None) -> Any:
    """The verification Job's hashing where the spec asks for it and a client can be had; else None (here)."""
    spec = run.spec.nodes.kubernetes
    if run.spec.nodes.backend != "kubernetes" or spec is None or not spec.verify_pods or connect is None:
        return None
    from trainyard.backends.kubernetes.verify import verify_in_cluster

    return verify_in_cluster(connect(spec), spec, checkpoint, spec.verify_pods, spec.verify_timeout_s)


@recorded("publish")
def publish(run: Run, checkpoint: str) -> PublishResult:
    """Copy the valid checkpoint to a cold-tier prefix of its own, verify the copy, then point ``PUBLISHED`` at it.

    ``uri`` names the copy itself, which is never written again (what downstream DAGs read);
    ``pointer`` names the object that always leads to the latest published copy.

    ``checkpoint`` (the gate's XCom) is only compared: what is published is what this run's gate recorded in
    the run's own ledger (``gated``).
    """
    src = gated(run, checkpoint)
    lease.renew_held(run.checkpoint_root, run.run_id, lease_ttl(run))  # retention must not take src meanwhile
    cold = run.tier(run.cold_checkpoint_uri, run.spec.checkpoint.connection)
    if run.spec.checkpoint.lifecycle:
        set_lifecycle(cold, run.spec.checkpoint.lifecycle, f"trainyard-{run.dag_id}-checkpoints")
    keep = lease.keeper(run.checkpoint_root, run.run_id, lease_ttl(run))  # an upload may outlast the lease
    copy = cold_copies.publish(src, cold, run.run_id, on_file=keep)
    uri, pointer = f"{run.cold_checkpoint_uri}/{copy.name}", f"{run.cold_checkpoint_uri}/{cold_copies.POINTER}"
    run.ledger.append("publish", "published", uri=uri, pointer=pointer, step=copy.step, bytes=copy.bytes)
    return PublishResult(uri=uri, pointer=pointer, step=copy.step, bytes=copy.bytes)

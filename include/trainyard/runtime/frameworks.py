"""What the framework adapters share (``trainyard.runtime.hf``, ``trainyard.runtime.lightning``): one optimizer
step reported as trainyard's own loop reports it, and the checkpoint a framework resumes from.

A framework owns its loop and its checkpoint files; trainyard adopts those files into its lineage when it sees a
save complete (``trainyard.checkpoint.foreign``), validates them and picks the one a relaunch resumes from, named
in ``TRAINYARD_RESUME_FROM``. ``resume_checkpoint`` turns that choice into the path the framework loads.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainyard.checkpoint import foreign
from trainyard.errors import TrainingFailed
from trainyard.runtime import snapshots
from trainyard.runtime.checkpoints import resolve_resume
from trainyard.runtime.drills import Drills
from trainyard.runtime.process import RunContext, context, ledger_event, on_rank0, rank
from trainyard.runtime.progress import finish, flush_progress, heartbeat

log = logging.getLogger("trainyard.workload")
Materialize = Callable[[Any, Path], Path]
"""Writes a snapshot's state (``snapshots.read_tree``) as a framework's own files under the folder given; what it loads."""


class StepReporter:
    """Heartbeats, step events, the in-process drills and the last word of a framework's training loop.

    ``before(step)`` at the start of an optimizer step, ``after(step, metrics)`` at its end, ``saving(step)``
    when the framework starts a save (the steps before it reach the ledger first), ``done(step)`` when training
    ends. A non-finite loss ends the run as ``diverged``: a framework would checkpoint a diverged model, and the
    supervisor rolls back to the last valid checkpoint instead.
    """

    def __init__(self, ctx: RunContext | None = None):
        self.ctx = ctx or context()  # also makes an uncaught exception leave a failure record
        self.drills = Drills(self.ctx)
        self.metrics: dict[str, float] = {}
        self._started: float | None = None
        self._step_s = 0.0

    def before(self, step: int) -> None:
        self.drills.at_rank(rank())
        self._started = time.monotonic()
        self.drills.before_step(step, self._step_s)

    def log(self, metrics: dict[str, Any]) -> None:
        """Keep the numbers of ``metrics`` for the next heartbeat (a framework logs apart from its steps)."""
        self.metrics.update({k: float(v) for k, v in metrics.items() if _number(v)})

    def after(self, step: int, metrics: dict[str, Any]) -> None:
        self.log(metrics)
        if self._started is not None:
            self._step_s = time.monotonic() - self._started
            self.metrics["step_ms"] = self._step_s * 1e3  # as trainyard's own loop reports it
        if "loss" in self.metrics:
            self.metrics["loss"] = self.drills.loss(step, self.metrics["loss"])
        heartbeat(step, dict(self.metrics), ctx=self.ctx)
        loss = self.metrics.get("loss", 0.0)
        if not math.isfinite(loss):
            raise TrainingFailed(f"loss is {loss} at step {step}", kind="diverged")

    def saving(self, step: int) -> None:
        flush_progress(self.ctx)

    def done(self, step: int) -> None:
        finish(step, dict(self.metrics), ctx=self.ctx)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def resume_checkpoint(kind: str, ctx: RunContext | None = None, materialize: Materialize | None = None) -> Path | None:
    """What a framework of ``kind`` (``hf``, ``lightning``, ``torch``, ``dcp``) resumes from, per
    ``TRAINYARD_RESUME_FROM``: the adopted checkpoint's folder (``hf``, ``dcp``) or its one file (``lightning``:
    ``.ckpt``, ``torch``: ``.pt``); None for a fresh start, or when the checkpoint trainyard chose was written
    by another format (a script changed its framework: it starts fresh rather than load what it cannot read).

    On a relaunch of the run (``latest``) where the adapter keeps in-memory snapshots (``materialize``: writes a
    snapshot's state as the files the framework loads, under a folder it is given, and returns what to load),
    the newest whole snapshot any rank holds wins when it is newer than that checkpoint
    (``runtime.snapshots.fetch``, collective: the default process group is formed here where the framework has
    not formed it yet). Every rank must call it."""
    ctx = ctx or context()
    relaunch = ctx.resume_from.strip().lower() == "latest"
    snapshotting = relaunch and materialize is not None and snapshots.node_tier(ctx) is not None
    if snapshotting:
        join_group()
    chosen = on_rank0(lambda: resolve_resume(ctx))
    target = _adopted(chosen, kind)
    why = "resume_from names this checkpoint"
    if snapshotting and materialize is not None:
        from_snapshot, why = _snapshot(ctx, int(chosen[1]["step"]) if target and chosen else 0, kind, materialize)
        if from_snapshot is not None:
            return from_snapshot
    if target is None or chosen is None:
        return None
    path, manifest = chosen
    if rank() == 0:  # the framework loads it next: the step it resumes from, as load_latest
        ledger_event(
            ctx, "resumed", step=int(manifest["step"]), path=str(path), source="checkpoint", why=why,
            from_world_size=manifest.get("world_size"), from_global_batch=manifest.get("global_batch"),
        )  # fmt: skip
    return target


def _adopted(chosen: tuple[Path, dict[str, Any]] | None, kind: str) -> Path | None:
    """The file or folder of the chosen checkpoint the framework loads; None where it starts fresh."""
    if chosen is None:
        return None
    path, manifest = chosen
    written = manifest.get("framework", "trainyard")
    if written != kind:
        log.warning("the checkpoint to resume, %s, was written as %r, not %r: starting fresh", path, written, kind)
        return None
    return foreign.resume_file(path, kind)


def _snapshot(ctx: RunContext, checkpoint_step: int, kind: str, materialize: Materialize) -> tuple[Path | None, str]:
    """Collectively: the newest whole snapshot newer than ``checkpoint_step``, written out in the framework's own
    files for this rank (``materialize``: what it loads, under the snapshot's folder), or None where the
    checkpoint stands; and why, in words."""
    found, why = snapshots.chosen(ctx, checkpoint_step, kind)
    if found is None:
        return None, why
    started = time.monotonic()
    # The framework reads files of its own format: written now, once per relaunch, never at a training step.
    target = materialize(snapshots.read_tree(found.path), found.path / f"{kind}-rank-{rank()}")
    return target, snapshots.resumed(ctx, found, checkpoint_step, started)


def join_group() -> None:
    """Form the default process group from torchrun's variables (``env://``) where a world of several processes
    has none yet: gloo on the CPU, NCCL on this rank's GPU. Trainer (accelerate) and Lightning's DDP strategy
    use a group that exists rather than form their own."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")

"""A Lightning ``Trainer`` under trainyard: a few lines in the user's script::

    from trainyard.runtime import lightning as ty

    trainer = L.Trainer(accelerator="cpu", **ty.trainer_kwargs())
    trainer.fit(module, DataLoader(data, batch_size=ty.micro_batch()), ckpt_path=ty.resume_checkpoint())

``trainer_kwargs`` gives the ``TrainyardCallback`` (heartbeats, progress and step events, the in-process
drills, a failure record for an exception, the ``finished`` word, a checkpoint of the last step), a
``ModelCheckpoint`` every ``TRAINYARD_CHECKPOINT_EVERY`` steps under ``TRAINYARD_CHECKPOINT_DIR/lightning``
(trainyard adopts each complete ``.ckpt`` into its lineage), ``max_steps``, gradient accumulation from
``TRAINYARD_GLOBAL_BATCH``/``TRAINYARD_MICRO_BATCH`` (a scale-down keeps the global batch; the DataLoader's batch
is ``micro_batch()``), and the devices and nodes of the torchrun world it runs in. ``resume_checkpoint`` is the
``.ckpt`` trainyard chose to resume from (None: fresh).

The callback also keeps an in-memory snapshot of every due step (``TRAINYARD_SNAPSHOT_EVERY``) in the node's
memory tier (``trainyard.runtime.snapshots``): Lightning's own checkpoint dict, as ``trainer.save_checkpoint``
makes it (weights, optimizers, schedulers, loops, callbacks; the module's ``on_save_checkpoint`` hook runs), its
tensors copied straight into shared memory. On a relaunch of the run ``resume_checkpoint`` writes the newest
whole one out as one ``snapshot.ckpt`` and names it when it is newer than the adopted checkpoint, for
``fit(ckpt_path=)``. Replicated state only (single device, DDP): under
DeepSpeed, FSDP or model parallelism the ``ModelCheckpoint`` saves stand alone.

Importing this module imports lightning; ``trainyard.runtime`` itself does not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

from trainyard.runtime import frameworks
from trainyard.runtime.batch import follow_batch
from trainyard.runtime.failures import record_failure
from trainyard.runtime.frameworks import StepReporter
from trainyard.runtime.process import RunContext, context
from trainyard.runtime.snapshots import Snapshotter

KIND = "lightning"
FOLDER = "lightning"
"""Where under the checkpoint root the ``.ckpt`` files go."""
SNAPSHOT_FILE = "snapshot.ckpt"
"""The checkpoint file in an in-memory snapshot's folder."""


class TrainyardCallback(pl.Callback):
    """Reports every optimizer step of a Lightning ``Trainer`` to trainyard, and saves the last step's checkpoint
    (a run's gate needs the step it trained to; ``ModelCheckpoint`` saves only every n steps), and keeps its state
    in the node's memory at every due step (``snapshot``)."""

    def __init__(self, ctx: RunContext | None = None, dirpath: Path | None = None):
        self.reporter = StepReporter(ctx)
        self.dirpath = dirpath or Path(self.reporter.ctx.checkpoint_dir) / FOLDER
        self._stepped = -1
        self.snapshots = Snapshotter(self.reporter.ctx, KIND)
        self._dumping = False

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_step != self._stepped:  # the first micro-batch of an optimizer step
            self._stepped = trainer.global_step
            self.reporter.before(trainer.global_step + 1)

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        if trainer.global_step == self._stepped:
            return  # an accumulating micro-batch: the optimizer has not stepped
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        if loss is not None:
            metrics["loss"] = float(loss)
        self.reporter.after(trainer.global_step, metrics)
        self.snapshot(trainer)

    def snapshot(self, trainer: pl.Trainer) -> float:
        """The step's checkpoint dict, copied into the node's memory tier: the seconds the step was held up."""
        if not _replicated(trainer.strategy):
            return 0.0  # each rank holds a part, and dumping it is collective: the ModelCheckpoint saves stand alone
        return self.snapshots.keep(trainer.global_step, lambda: self._dump(trainer))

    def _dump(self, trainer: pl.Trainer) -> dict[str, Any]:
        self._dumping = True
        try:
            return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._dumping = False

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict) -> None:
        if not self._dumping:  # a snapshot is no save: the steps reach the ledger at their own pace
            self.reporter.saving(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        step = trainer.global_step
        last = self.dirpath / f"step={step}.ckpt"
        if not any(self.dirpath.glob(f"*step={step}.ckpt")):
            trainer.save_checkpoint(last)
        self.reporter.done(step)

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        record_failure(exception, self.reporter.ctx)


def _replicated(strategy: Any) -> bool:
    """Whether every rank holds the whole state (one device, DDP), so a node's one copy is whole."""
    return isinstance(strategy, SingleDeviceStrategy) or (
        isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy)
    )


def _materialize(checkpoint: dict[str, Any], folder: Path) -> Path:
    """A snapshot as the ``.ckpt`` file ``Trainer.fit(ckpt_path=)`` loads."""
    folder.mkdir(exist_ok=True)
    torch.save(checkpoint, folder / SNAPSHOT_FILE)
    return folder / SNAPSHOT_FILE


def micro_batch(ctx: RunContext | None = None) -> int:
    """The DataLoader's batch size: the run's micro-batch (with ``trainer_kwargs``' accumulation, the global batch)."""
    return follow_batch(ctx or context()).micro_batch


def trainer_kwargs(ctx: RunContext | None = None, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``lightning.Trainer`` for the run; ``overrides`` win (callbacks are added to)."""
    ctx = ctx or context()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", str(local)))
    folder = Path(ctx.checkpoint_dir) / FOLDER
    saves = ModelCheckpoint(
        dirpath=folder, filename="{step}", every_n_train_steps=ctx.checkpoint_every or ctx.max_steps,
        save_top_k=-1, save_last=False,
    )  # fmt: skip
    callbacks = [TrainyardCallback(ctx, folder), saves, *overrides.pop("callbacks", [])]
    settings: dict[str, Any] = {
        "max_steps": ctx.max_steps,
        "accumulate_grad_batches": follow_batch(ctx).accumulation,
        "devices": local,
        "num_nodes": max(1, world // local),
        "strategy": "ddp" if world > 1 else "auto",
        "callbacks": callbacks,
        "logger": False,
        "enable_progress_bar": False,
        "default_root_dir": str(folder),
    }
    settings.update(overrides)
    return settings


def resume_checkpoint(ctx: RunContext | None = None) -> str | None:
    """The ``.ckpt`` (as trainyard adopted it) to pass to ``Trainer.fit(ckpt_path=)``; on a relaunch the newest
    in-memory snapshot's where it is newer. Every rank must call it."""
    path = frameworks.resume_checkpoint(KIND, ctx, materialize=_materialize)
    return str(path) if path is not None else None

"""A Hugging Face ``Trainer`` under trainyard: a few lines in the user's script::

    from trainyard.runtime import hf

    args = hf.training_args(learning_rate=3e-4)  # batch, steps, saves and seed from the run
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[hf.TrainyardCallback()])
    trainer.train(resume_from_checkpoint=hf.resume_checkpoint())

``TrainyardCallback`` gives heartbeats (so hang detection applies), progress and step events, the in-process
drills, a failure record for an uncaught exception and the ``finished`` word. ``training_args`` sets the
per-device batch and gradient accumulation from ``TRAINYARD_GLOBAL_BATCH``/``TRAINYARD_MICRO_BATCH`` (a
scale-down keeps the global batch), ``max_steps``, ``save_steps`` and the seed from the run, and writes the
Trainer's ``checkpoint-N/`` folders under ``TRAINYARD_CHECKPOINT_DIR/hf``, where trainyard adopts each complete
save into its lineage. ``resume_checkpoint`` is the adopted folder trainyard chose to resume from (None: fresh).

The callback also keeps an in-memory snapshot of every due step (``TRAINYARD_SNAPSHOT_EVERY``) in the node's
memory tier (``trainyard.runtime.snapshots``): what the Trainer's own ``checkpoint-N/`` holds (weights,
optimizer, scheduler, ``TrainerState`` and the writer's RNG), its tensors copied straight into shared memory. On
a relaunch of the run ``resume_checkpoint`` writes the newest whole one out as a ``checkpoint-N/`` folder
(``pytorch_model.bin``, ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``, ``rng_state*.pth``) and names
it when it is newer than the adopted checkpoint; ``Trainer.train(resume_from_checkpoint=)`` loads it as its own
save (skipping the batches already seen). Replicated state only: under DeepSpeed or FSDP the Trainer's own saves stand alone.

Importing this module imports transformers; ``trainyard.runtime`` itself does not.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.training_args import ParallelMode
from transformers.utils import WEIGHTS_NAME

from trainyard.runtime import frameworks
from trainyard.runtime.batch import follow_batch
from trainyard.runtime.frameworks import StepReporter
from trainyard.runtime.process import RunContext, context
from trainyard.runtime.snapshots import Snapshotter

KIND = "hf"
FOLDER = "hf"
"""Where under the checkpoint root the Trainer writes its ``checkpoint-N/`` folders."""


class TrainyardCallback(TrainerCallback):
    """Reports every optimizer step of a ``Trainer`` to trainyard (``trainyard.runtime.frameworks.StepReporter``)
    and keeps its state in the node's memory at every due step (``snapshot``)."""

    def __init__(self, ctx: RunContext | None = None):
        self.reporter = StepReporter(ctx)
        self.snapshots = Snapshotter(self.reporter.ctx, KIND)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.reporter.before(state.global_step + 1)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None,
        **kw: Any,
    ) -> None:  # fmt: skip
        if logs:
            self.reporter.log({"lr" if k == "learning_rate" else k: v for k, v in logs.items()})

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.reporter.after(state.global_step, {})
        self.snapshot(args, state, kw)
        if control.should_save:
            self.reporter.saving(state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.reporter.done(state.global_step)

    def snapshot(self, args: TrainingArguments, state: TrainerState, kw: dict[str, Any]) -> float:
        """The step's state, copied into the node's memory tier: the seconds the step was held up."""
        if args.deepspeed or args.fsdp or kw.get("optimizer") is None or kw.get("lr_scheduler") is None:
            return 0.0  # sharded (each rank holds a part) or not built: the Trainer's own saves stand alone
        return self.snapshots.keep(state.global_step, lambda: _state(args, state, kw))


def _state(args: TrainingArguments, state: TrainerState, kw: dict[str, Any]) -> dict[str, Any]:
    """What ``Trainer._save_checkpoint`` writes, by its file names (the tensors are copied into the tier next)."""
    kept = copy.copy(state)
    kept.log_history = list(state.log_history)  # its entries are never changed once logged: no deep copy
    kept.stateful_callbacks = copy.deepcopy(state.stateful_callbacks)
    distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
    rng = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    return {
        WEIGHTS_NAME: kw["model"].state_dict(),
        OPTIMIZER_NAME: kw["optimizer"].state_dict(),
        SCHEDULER_NAME: kw["lr_scheduler"].state_dict(),
        rng: rng_states(distributed),
        TRAINER_STATE_NAME: kept,
    }


def _materialize(state: dict[str, Any], folder: Path) -> Path:
    """A snapshot as the ``checkpoint-N`` folder ``Trainer.train(resume_from_checkpoint=)`` loads."""
    folder.mkdir(exist_ok=True)
    for name, value in state.items():
        if isinstance(value, TrainerState):
            value.save_to_json(str(folder / name))
        else:
            torch.save(value, folder / name)
    return folder


def rng_states(distributed: bool) -> dict[str, Any]:
    """This process's random generators as ``Trainer._save_rng_state`` saves them (``_load_rng_state`` reads
    them back): Python, NumPy, the CPU and CUDA's (every device's in a distributed run)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return states


def training_args(ctx: RunContext | None = None, **overrides: Any) -> TrainingArguments:
    """``TrainingArguments`` with the run's batch split, steps, saves, seed and output folder; ``overrides`` win
    (a script that overrides the batch settings takes the global batch into its own hands)."""
    ctx = ctx or context()
    batch = follow_batch(ctx)
    every = ctx.checkpoint_every or ctx.max_steps
    settings: dict[str, Any] = {
        "output_dir": str(Path(ctx.checkpoint_dir) / FOLDER),
        "max_steps": ctx.max_steps,
        "per_device_train_batch_size": batch.micro_batch,
        "gradient_accumulation_steps": batch.accumulation,
        "save_strategy": "steps",
        "save_steps": every,
        "logging_steps": 1,  # the loss of every step reaches the heartbeat
        "seed": ctx.seed,
        "report_to": [],
        "disable_tqdm": True,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def resume_checkpoint(ctx: RunContext | None = None) -> str | None:
    """The ``checkpoint-N`` folder (as trainyard adopted it) to pass to ``Trainer.train(resume_from_checkpoint=)``;
    on a relaunch the newest in-memory snapshot's folder where it is newer. Every rank must call it."""
    path = frameworks.resume_checkpoint(KIND, ctx, materialize=_materialize)
    return str(path) if path is not None else None

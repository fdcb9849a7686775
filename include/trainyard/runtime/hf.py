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

Importing this module imports transformers; ``trainyard.runtime`` itself does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainyard.runtime import frameworks
from trainyard.runtime.batch import follow_batch
from trainyard.runtime.frameworks import StepReporter
from trainyard.runtime.process import RunContext, context

KIND = "hf"
FOLDER = "hf"
"""Where under the checkpoint root the Trainer writes its ``checkpoint-N/`` folders."""


class TrainyardCallback(TrainerCallback):
    """Reports every optimizer step of a ``Trainer`` to trainyard (``trainyard.runtime.frameworks.StepReporter``)."""

    def __init__(self, ctx: RunContext | None = None):
        self.reporter = StepReporter(ctx)

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
        if control.should_save:
            self.reporter.saving(state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self.reporter.done(state.global_step)


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
    """The ``checkpoint-N`` folder (as trainyard adopted it) to pass to ``Trainer.train(resume_from_checkpoint=)``."""
    path = frameworks.resume_checkpoint(KIND, ctx)
    return str(path) if path is not None else None

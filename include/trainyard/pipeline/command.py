"""One attempt's command line, folder and variables, rendered from the spec when its plan is made.

``spec.args`` says how the spec's ``training.args`` become argv and checks them; here they meet the run: the
templates get their values (the run's identifiers, ``${VAR}``, trainyard's folders, the attempt's target step),
and ``resume_args`` join only when the attempt resumes from a checkpoint. A template that cannot be filled is a
``SpecError`` naming the field, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainyard.errors import SpecError
from trainyard.pipeline.run import Run
from trainyard.spec.args import RESUME_TEMPLATE, command_line
from trainyard.spec.templating import render


@dataclass(frozen=True)
class Command:
    args: list[str]
    workdir: str | None
    env: dict[str, str]


def template_values(run: Run, target: int) -> dict[str, str]:
    """What ``{{ name }}`` stands for in args, resume_args, env and workdir (``spec.args.ARG_NAMES``)."""
    return {
        **run.variables,
        "data_dir": str(run.hot_dataset_dir),
        "checkpoint_dir": str(run.checkpoint_root),
        "run_dir": str(run.dir),
        "max_steps": str(target),
    }


def attempt_command(run: Run, target: int, resume_target: str | None) -> Command:
    """The attempt's argv after the entrypoint, its folder and variables; ``resume_target``: the checkpoint it
    resumes from (None: it starts fresh, and gets no ``resume_args``)."""
    training, values = run.spec.training, template_values(run, target)

    def fill(field: str, text: str, extra: dict[str, str] | None = None) -> str:
        try:
            return render(text, {**values, **(extra or {})})
        except KeyError as exc:
            raise SpecError([f"{run.spec_path}: {field}: {exc.args[0]}"]) from None

    try:
        args = command_line(training.args, training.args_form, training.booleans, fill)
    except ValueError as exc:  # a spec that did not pass ``trainyard check`` (a hand-built one)
        raise SpecError([f"{run.spec_path}: {exc}"]) from None
    if resume_target is not None:
        resumed = {RESUME_TEMPLATE: resume_target}
        args += [fill(f"training.resume_args[{i}]", a, resumed) for i, a in enumerate(training.resume_args)]
    workdir = fill("training.workdir", training.workdir) if training.workdir else None
    if workdir is not None and run.spec.nodes.backend == "local" and not Path(workdir).is_dir():
        raise SpecError([f"{run.spec_path}: training.workdir: {workdir!r} is not a folder; create it or fix the path"])
    env = {name: fill(f"training.env.{name}", value) for name, value in training.env.items()}
    return Command(args=args, workdir=workdir, env=env)

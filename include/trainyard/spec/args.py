"""A script's command line as the spec writes it, and what ``trainyard check`` refuses in it.

``training.args`` is a mapping (order kept) or a list of items: a string item is passed as is (a positional
argument, a literal flag), a mapping item is rendered by ``args_form`` and ``booleans``. ``resume_args`` come
after them only when an attempt resumes from a checkpoint; ``env`` is set for the ranks. This module owns their
vocabularies, the rendering (``command_line``, pure: templates are filled by the caller's ``fill``), the one
accessor every reader of a named argument uses (``arg_entries``) and the checks. The pipeline renders them when
an attempt's plan is made (``pipeline.command``), where the run's folders are known.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainyard.spec.templating import RUN_VARIABLES, placeholder_problems

Scalar = str | int | float | bool
ArgValue = Scalar | list[Scalar]
ArgMap = dict[str, ArgValue]
ArgItem = str | ArgMap
Args = ArgMap | list[ArgItem]

ArgsForm = Literal["--key value", "--key=value"]
"""How a mapping's entry is written: two words (argparse's default) or one (``--key=value``, what nanoGPT's
configurator and ``HfArgumentParser`` take too)."""
Booleans = Literal["flag", "flag/--no-flag", "true/false", "True/False", "1/0"]
"""How a YAML boolean in a mapping is written: ``flag`` true is a bare ``--key`` (false is refused: leaving it out
would drop it silently), ``flag/--no-flag`` false is ``--no-key`` (argparse's ``BooleanOptionalAction``); the
others write the value in that spelling."""
BOOLEAN_WORDS: dict[str, tuple[str, str]] = {"true/false": ("true", "false"), "True/False": ("True", "False"),
                                             "1/0": ("1", "0")}  # fmt: skip

FOLDER_TEMPLATES = ("data_dir", "checkpoint_dir", "run_dir", "max_steps")
"""trainyard's own values an argument, a resume argument, ``env`` and ``workdir`` may name, beside the run's."""
RESUME_TEMPLATE = "resume_from"
"""The checkpoint trainyard chose to resume from: only in ``resume_args`` (it has a value only then)."""
ARG_NAMES = (*RUN_VARIABLES, *FOLDER_TEMPLATES)
RESUME_NAMES = (*ARG_NAMES, RESUME_TEMPLATE)

# What the launchers set for every rank (torchrun's world, the GPUs they split, the pod's index): a value of the
# spec's would break the contract or be overwritten without a word.
RESERVED_ENV = frozenset({"RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                          "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                          "JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED"})  # fmt: skip
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# A key is a flag's name: no '=' (``"n_layer=2": true`` was a trick for --key=value; args_form says it now).
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")

# ---------------------------------------------------------------- validation (the model's field)


def valid_args(value: Any) -> Args:
    """``training.args`` as the model keeps it; ``ValueError`` says what is wrong and the fix, its message starting
    with the place inside (``.lr: ``, ``[2]: ``), which ``spec.messages.describe`` joins to the field's path."""
    if isinstance(value, dict):
        return _arg_map(value)
    if isinstance(value, list):
        return [_arg_item(item, i) for i, item in enumerate(value)]
    raise ValueError("write a mapping of --key values, or a list of strings (passed as is) and mappings")


def _arg_item(item: Any, i: int) -> ArgItem:
    if isinstance(item, dict):
        return _arg_map(item, f"[{i}]")
    if isinstance(item, (int, float)) and not isinstance(item, bool):
        return str(_scalar(item, "a list item"))  # a positional number: as Python writes it
    if isinstance(item, str):
        return item
    raise ValueError(f"[{i}]: {_kind(item)} is not an item; write a string (passed as is) or a mapping (--key value)")


def _arg_map(value: dict[Any, Any], where: str = "") -> ArgMap:
    out: ArgMap = {}
    for key, item in value.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(
                f"{where}.{key}: not a flag's name (letters, digits, '_', '-', '.'); for"
                " --key=value write the value under the key and set training.args_form: '--key=value'"
            )
        try:
            out[key] = [_scalar(v, "a list item") for v in item] if isinstance(item, list) else _scalar(item, "")
        except ValueError as exc:
            raise ValueError(f"{where}.{key}: {exc}") from None
    return out


def _scalar(value: Any, what: str) -> Scalar:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    if isinstance(value, (str, int, float)):  # bool is an int
        return value
    what = what or "an argument's value"
    raise ValueError(
        f"{_kind(value)} is not allowed as {what}; write a string, number or boolean"
        + ("" if what == "a list item" else ", or a list of them (--key v1 v2 ...)")
    )


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class ArgEntry:
    field: str
    """Its path in the spec: ``training.args[0]``, ``training.args.lr``, ``training.args[1].lr``."""
    key: str | None
    """The flag's name; None for a string item (passed as is)."""
    value: ArgValue


def arg_entries(args: Args) -> list[ArgEntry]:
    """Every argument in order, with its field: the one reading of both forms."""
    if isinstance(args, dict):
        return [ArgEntry(f"training.args.{k}", k, v) for k, v in args.items()]
    out = []
    for i, item in enumerate(args):
        if isinstance(item, str):
            out.append(ArgEntry(f"training.args[{i}]", None, item))
        else:
            out += [ArgEntry(f"training.args[{i}].{k}", k, v) for k, v in item.items()]
    return out


def named(args: Args) -> dict[str, ArgValue]:
    """The named arguments (a later one of the same name wins, as argparse's last flag does)."""
    return {e.key: e.value for e in arg_entries(args) if e.key is not None}


def with_arg(args: Any, name: str, value: Any) -> Any:
    """Raw ``args`` data (a dumped spec's) with ``name`` set: where it is named, else added at the end."""
    if isinstance(args, dict):
        return {**args, name: value}
    items = list(args or [])
    for i, item in enumerate(items):
        if isinstance(item, dict) and name in item:
            items[i] = {**item, name: value}
            return items
    return [*items, {name: value}]


# ---------------------------------------------------------------- rendering


def command_line(args: Args, form: ArgsForm, booleans: Booleans, fill: Callable[[str, str], str]) -> list[str]:
    """The argv of ``args`` in the order written; ``fill(field, text)`` renders a string's templates.
    ``ValueError`` for what ``arg_problems`` refuses (a spec that skipped ``trainyard check``)."""
    out: list[str] = []
    for entry in arg_entries(args):
        if entry.key is None:
            out.append(fill(entry.field, str(entry.value)))
        else:
            out += _rendered(entry, form, booleans, fill)
    return out


def _rendered(entry: ArgEntry, form: ArgsForm, booleans: Booleans, fill: Callable[[str, str], str]) -> list[str]:
    key, value = f"--{entry.key}", entry.value
    if isinstance(value, bool) and booleans not in BOOLEAN_WORDS:
        if value:
            return [key]
        if booleans == "flag":
            raise ValueError(f"{entry.field}: {_FALSE_FLAG}")
        return [f"--no-{entry.key}"]
    if isinstance(value, list):
        if form == "--key=value":
            raise ValueError(f"{entry.field}: {_LIST_ONE_WORD}")
        return [key, *(fill(entry.field, _text(v, booleans)) for v in value)]
    text = fill(entry.field, _text(value, booleans))
    return [f"{key}={text}"] if form == "--key=value" else [key, text]


def _text(value: Scalar, booleans: Booleans) -> str:
    # A number as Python writes it (YAML 1.0e-4 -> 0.0001, 3e-4 without a dot is YAML's string '3e-4').
    if isinstance(value, bool):
        words = BOOLEAN_WORDS.get(booleans, ("true", "false"))
        return words[0] if value else words[1]
    return str(value)


_FALSE_FLAG = (
    "false cannot be written with training.booleans: flag (a bare flag means true, and leaving it out would drop"
    " it silently); set training.booleans to flag/--no-flag, true/false, True/False or 1/0 (what the script"
    " parses), or remove the key"
)
_LIST_ONE_WORD = (
    "a list cannot be written as --key=value (argparse would take its first item only); write one string the"
    " script parses (such as '[0.9,0.95]' or '0.9,0.95'), or set training.args_form: '--key value' (--key v1 v2)"
)

# ---------------------------------------------------------------- checks


def arg_problems(args: Args, form: ArgsForm, booleans: Booleans, resume_args: Sequence[str]) -> list[str]:
    """What would not reach the script as written, and templates ``trainyard check`` refuses, naming the field."""
    problems = []
    for e in arg_entries(args):
        if e.value is False and booleans == "flag":
            problems.append(f"{e.field}: {_FALSE_FLAG}")
        if isinstance(e.value, list) and form == "--key=value":
            problems.append(f"{e.field}: {_LIST_ONE_WORD}")
        for text in e.value if isinstance(e.value, list) else [e.value]:
            if isinstance(text, str):
                problems += _templates(e.field, text, ARG_NAMES)
    for i, text in enumerate(resume_args):
        problems += _templates(f"training.resume_args[{i}]", text, RESUME_NAMES)
    return problems


def env_problems(env: Mapping[str, str]) -> list[str]:
    problems = []
    for name, value in env.items():
        field = f"training.env.{name}"
        if not _ENV_NAME.match(name):
            problems.append(f"{field}: not a variable name (letters, digits and '_', not first a digit)")
        elif name.startswith("TRAINYARD_") or name in RESERVED_ENV:
            problems.append(f"{field}: set by trainyard's launchers for every rank (the contract); remove it")
        problems += _templates(field, value, ARG_NAMES)
    return problems


def workdir_problems(workdir: str | None, backend: str) -> list[str]:
    """A plain local ``workdir`` must be an existing folder now (one with templates is checked when the attempt
    starts); a pod's is inside its image, which the orchestrator cannot look into."""
    if workdir is None:
        return []
    if problems := _templates("training.workdir", workdir, ARG_NAMES):
        return problems
    if "{{" in workdir or "${" in workdir or backend != "local":
        return []
    if not Path(workdir).is_absolute():
        return [f"training.workdir: {workdir!r} must be an absolute folder (a relative one is the spec file's)"]
    if not Path(workdir).is_dir():
        return [f"training.workdir: {workdir!r} is not a folder on this machine; create it or fix the path"]
    return []


def _templates(field: str, text: str, names: tuple[str, ...]) -> list[str]:
    return [f"{field}: {p}" for p in placeholder_problems(text, names=names, require_set=True)]


def resolve_relative(data: Any, folder: Path) -> Any:
    """Raw spec data with a relative ``.py`` entrypoint and a relative ``workdir`` made the spec file's, on the local
    backend (as a user reads the file beside the spec); a pod resolves them in its image's folders."""
    if not isinstance(data, dict) or not isinstance(training := data.get("training"), dict):
        return data
    nodes = data.get("nodes")
    if (nodes.get("backend", "local") if isinstance(nodes, dict) else "local") != "local":
        return data
    out = dict(training)
    for name in ("entrypoint", "workdir"):
        text = out.get(name)
        if isinstance(text, str) and text and not text.startswith(("/", "{{", "${")):
            if name == "workdir" or text.endswith(".py"):
                out[name] = str(folder.absolute() / text)
    return {**data, "training": out}

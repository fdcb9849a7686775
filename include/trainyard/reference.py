"""The reference workload's command line, declared once: ``trainyard.workload`` parses it, and the spec check
(``spec.checks``) refuses a ``training.args`` it would refuse, before a run starts rather than when the
ranks do. No imports: the orchestrator and every training process read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

REFERENCE_WORKLOAD = "trainyard.workload"


@dataclass(frozen=True)
class Flag:
    kind: type[int] | type[float] | type[str]
    default: int | float | str
    help: str = ""
    choices: tuple[str, ...] = ()


FLAGS: dict[str, Flag] = {
    "seq-len": Flag(int, 64),
    "d-model": Flag(int, 64),
    "n-layers": Flag(int, 2),
    "n-heads": Flag(int, 4),
    "vocab-size": Flag(int, 256),
    "data-dtype": Flag(
        str,
        "uint16",
        "token dtype of raw .bin arrays (dataset.format: numpy; nanoGPT: uint16); .tok and .npy say their own",
        ("uint16", "uint32"),
    ),
    "lr": Flag(float, 1e-2, "peak learning rate (AdamW)"),
    "warmup-steps": Flag(int, 5, "linear warmup; constant afterwards"),
    "weight-decay": Flag(float, 0.1),
    "grad-clip": Flag(float, 1.0, "max global grad norm (0: off)"),
}


def flag_problems(entries: Iterable[Any]) -> list[str]:
    """What the reference workload would refuse in ``training.args`` (its ``spec.args.arg_entries``, either form):
    positional items, unknown flags and values of the wrong type."""
    problems = []
    for entry in entries:
        key, value, field = entry.key, entry.value, entry.field
        flag = FLAGS.get(key) if key is not None else None
        if key is None:
            problems.append(
                f"{field}: {REFERENCE_WORKLOAD} takes no positional arguments (it takes {', '.join(FLAGS)})"
            )
        elif flag is None:
            near = f"; did you mean {key.replace('_', '-')}?" if key.replace("_", "-") in FLAGS else ""
            problems.append(f"{field}: {REFERENCE_WORKLOAD} has no --{key}{near} (it takes {', '.join(FLAGS)})")
        elif flag.choices and value not in flag.choices:
            problems.append(f"{field}: {value!r} is not one of {', '.join(flag.choices)}")
        elif not _fits(flag.kind, value):
            problems.append(f"{field}: {value!r} is not {_NAMES[flag.kind]}; write a number such as {flag.default}")
    return problems


_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _fits(kind: type, value: Any) -> bool:
    if isinstance(value, bool) or isinstance(value, list):
        return False
    if kind is int:
        return isinstance(value, int)
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, str | int | float)

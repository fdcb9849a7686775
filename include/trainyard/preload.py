"""What a training script's framework imports: the local zygote imports it once, so a rank forked from it starts warm.

A relaunch on the local backend forks its ranks from a process that already imported torch
(``backends.local.zygote``). A Hugging Face or Lightning script then still pays its framework's
import in every rank at every attempt (transformers' ~4 s of CPU here, Lightning's ~3 s); with the
framework imported in the zygote too, a rank's start-up is a fork. ``training.framework`` names it,
or ``auto`` reads it from the script's own imports. Each framework is one record here (rule 19): its
spec name, the modules imported before forking (fork-safe: they start no thread and touch no CUDA,
which the zygote checks after importing them) and the top-level import names that reveal it.

This module sits in the bottom layer (it imports nothing of trainyard): the spec names its values,
the zygote reads its records.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

Framework = Literal["auto", "none", "torch", "hf", "lightning"]
"""``training.framework``: a record of ``TABLE``, ``auto`` (read from the script) or ``none`` (cold starts)."""


@dataclass(frozen=True)
class Preload:
    modules: tuple[str, ...]
    """Imported by the zygote before it forks anything, in order."""
    reveals: tuple[str, ...]
    """Top-level names a script imports (``import X``, ``from X... import``) that say it uses this framework."""


TABLE: dict[str, Preload] = {
    "torch": Preload(("torch", "torch.distributed", "torch.nn.parallel"), reveals=()),
    # transformers is lazy: its trainer and model base are what a Trainer script's first lines load.
    "hf": Preload(
        ("transformers", "transformers.trainer", "transformers.modeling_utils", "trainyard.runtime.hf"),
        reveals=("transformers",),
    ),
    "lightning": Preload(
        ("lightning.pytorch", "trainyard.runtime.lightning"), reveals=("lightning", "pytorch_lightning")
    ),
}
if set(get_args(Framework)) != {"auto", "none", *TABLE}:  # pragma: no cover - a vocabulary out of step
    raise ImportError(f"preload: Framework {get_args(Framework)} and TABLE {sorted(TABLE)} disagree")

ADAPTERS = {"trainyard.runtime.hf": "transformers", "trainyard.runtime.lightning": "lightning"}
"""trainyard's adapters, which a script may import without importing their framework by name."""
MAX_SCRIPT_BYTES = 1 << 20
"""Bytes of a script ``auto`` reads: a larger one (or one that does not parse) is read as plain torch."""


def script_frameworks(source: str) -> list[str]:
    """The frameworks of ``TABLE`` a script's source imports anywhere (by its top-level import names), in
    ``TABLE``'s order; ``[]`` if it does not parse. Parsing runs nothing of the script."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # ``from trainyard.runtime import hf``
    names = {ADAPTERS.get(name, name).split(".")[0] for name in names}
    return [name for name, record in TABLE.items() if names & set(record.reveals)]


def modules_for(framework: str, script: Path | None) -> list[str]:
    """The modules to import for ``framework`` (``auto``: what ``script``, a ``.py`` file, imports; a module
    entrypoint's ``auto`` is plain torch); ``[]`` for ``none``. Always torch first."""
    if framework == "none":
        return []
    names = [framework] if framework in TABLE else []
    if framework == "auto" and script is not None:
        try:
            with script.open("rb") as handle:
                data = handle.read(MAX_SCRIPT_BYTES + 1)
        except OSError:
            data = b""
        if len(data) <= MAX_SCRIPT_BYTES:
            names = script_frameworks(data.decode("utf-8", "replace"))
    return [m for name in ["torch", *names] for m in TABLE[name].modules]

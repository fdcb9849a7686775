"""Inspect the ``torch.save`` files of an adopted framework save, in the inspecting child.

Each file (HF's ``optimizer.pt``, ``pytorch_model*.bin``, ``rng_state.pth``, ``training_args.bin``, a Lightning
``.ckpt``, a user's ``.pt``) is read once through ``readonce.Once`` (the digest returned is of the bytes
judged), its pickle's globals checked against ``checkpoint.pickles``' allow-list (anything else refused by
name, never loaded), then loaded with ``torch.load(weights_only=True)`` from those bytes and every
floating-point tensor checked finite. The allow-list's framework types beyond torch's weights-only set are
loaded as inert stand-ins (never the real class: nothing of transformers or Lightning is imported or run);
numpy's array and dtype builders are numpy's own, which only build arrays.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import _weights_only_unpickler

from trainyard.checkpoint import pickles
from trainyard.checkpoint.frameworks import STEP_KEYS
from trainyard.checkpoint.pickles import TORCH_FILES
from trainyard.checkpoint.readonce import Once

# What must be finite in a Lightning checkpoint: the model and the optimizer. Its callbacks' bookkeeping holds
# infinities by design (ModelCheckpoint's ``kth_value`` starts at inf when nothing is monitored).
Digests = dict[str, tuple[int, str]]


def weights_only() -> frozenset[str]:
    """The globals ``torch.load(weights_only=True)`` resolves by default, as this torch names them."""
    return frozenset(_weights_only_unpickler._get_allowed_globals())


class StandIn:
    """A framework object the allow-list accepts but this process never builds (``TrainingArguments``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _numpy_builders() -> dict[str, Any]:
    core = getattr(np, "_core", None) or np.core
    reconstruct, scalar = core.multiarray._reconstruct, core.multiarray.scalar
    return {
        "numpy.core.multiarray._reconstruct": reconstruct,
        "numpy._core.multiarray._reconstruct": reconstruct,
        "numpy.core.multiarray.scalar": scalar,
        "numpy._core.multiarray.scalar": scalar,
        "numpy.ndarray": np.ndarray,
        "numpy.dtype": np.dtype,
    }


def _safe_globals(extra: set[str]) -> list[Any]:
    """What ``torch.load`` may resolve beyond its own set: numpy's builders, stand-ins for the rest."""
    builders = _numpy_builders()
    found: list[Any] = [(builders.get(name, StandIn), name) for name in sorted(extra)]
    if extra & set(builders):  # a dtype is built as its class (numpy.dtypes.Float64DType): those may be built too
        found += [getattr(np.dtypes, n) for n in getattr(np.dtypes, "__all__", ())]
    return found


def tensors_in(value: Any, name: str) -> Any:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors_in(item, f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from tensors_in(item, f"{name}[{i}]")


def non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    # A sum is NaN or Inf if any element is, at memory speed; only then (or on overflow) count.
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()):
        return 0, 0
    return int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())


def load(raw: bytes, rel: str, base: frozenset[str]) -> tuple[Any, list[str], list[str]]:
    """``rel``'s bytes loaded weights-only, or the problem; the note naming the framework types it needed."""
    try:
        names = pickles.globals_in(pickles.data_pickle(raw))
    except pickles.NotAPickle as exc:
        return None, [f"{rel}: not a readable torch.save file ({exc})"], []
    if refused := sorted(names - pickles.allowed(rel, base)):
        shown = ", ".join(refused[:5])
        why = "not on the allow-list of what framework saves hold"
        return None, [f"{rel}: its pickle calls {shown} ({why}); refused, never loaded"], []
    extra = names - base
    try:
        with torch.serialization.safe_globals(_safe_globals(extra)):
            value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return None, [f"{rel}: does not load weights-only: {type(exc).__name__}: {reason}"], []
    notes = [f"{rel}: holds {', '.join(sorted(extra)[:5])} (allow-listed framework types, never built);"
             " its tensors checked, accepted on its hash"] if extra else []  # fmt: skip
    return value, [], notes


def file_problems(folder: Path, files: list[str], finite: tuple[str, ...] = ()) -> tuple[list[str], list[str], Digests]:
    """Problems, notes and digests of ``files`` (the save's torch.save files, as the manifest lists them).

    ``finite``: the top-level keys whose tensors must be finite (the format's ``Framework.finite``: a Lightning
    file's model and optimizer, not its callbacks' state); (): every tensor."""
    problems: list[str] = []
    notes: list[str] = []
    digests: Digests = {}
    base = weights_only()
    for rel in files:
        try:
            once = Once(folder, rel)
        except OSError as exc:
            problems.append(f"{rel}: cannot be read ({exc.strerror or exc})")
            continue
        with once:
            raw = once.read(once.size)
            value, found, noted = load(raw, rel, base)  # while the bytes hash on the side
            digests[rel] = once.finish()
        problems += found
        notes += noted
        if found:
            continue
        if finite and isinstance(value, dict):
            value = {key: value[key] for key in finite if key in value}
        for name, tensor in tensors_in(value, rel):
            nan, inf = non_finite(tensor)
            if nan or inf:
                problems.append(f"tensor {name} has {nan} NaN and {inf} Inf value(s)")
    return problems, notes, digests


def file_step(path: Path, key: str | None = None) -> int | None:
    """The step a torch.save file (or a folder of them, overwritten in place) holds at its top, loaded
    weights-only: ``key`` (the spec's ``checkpoint.step_key``) if given and there, else the first of
    ``frameworks.STEP_KEYS`` that is. In a folder, a key's rank wins over a file's order (``model.pt``'s ``epoch``
    loses to ``optim.pt``'s ``iter_num``), files by name."""
    folder = path.is_dir() and not path.is_symlink()
    held = [_counters(path, rel) for rel in torch_files(path)] if folder else [_counters(path.parent, path.name)]
    for name in ([key] if key else []) + list(STEP_KEYS):
        for counters in held:
            if name in counters:
                return counters[name]
    return None


def torch_files(folder: Path) -> list[str]:
    """The torch.save files of a save's folder and its subfolders one deep, by name; never through a link."""
    found: list[str] = []
    for top in sorted(os.scandir(folder), key=lambda e: e.name):
        if top.is_dir(follow_symlinks=False):
            found += [f"{top.name}/{e.name}" for e in sorted(os.scandir(top.path), key=lambda e: e.name)
                      if e.name.endswith(TORCH_FILES) and e.is_file(follow_symlinks=False)]  # fmt: skip
        elif top.name.endswith(TORCH_FILES) and top.is_file(follow_symlinks=False):
            found.append(top.name)
    return found


def largest(path: Path) -> int:
    """The bytes of the largest file a step request loads at once (the file itself, or a folder's largest)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
        return max(((path / rel).lstat().st_size for rel in torch_files(path)), default=0)
    except OSError:  # gone meanwhile: the load says why
        return 0


def _counters(folder: Path, rel: str) -> dict[str, int]:
    """The top-level step counters of one torch.save file, by key (only these kept: the rest is freed)."""
    with Once(folder, rel) as once:
        raw = once.read(once.size)
    value, found, _ = load(raw, rel, weights_only())
    if found or not isinstance(value, dict):
        return {}
    counters: dict[str, int] = {}
    for name, step in value.items():
        if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
            step = int(step.item())  # a counter kept as a 0-d integer tensor
        if isinstance(name, str) and isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            counters[name] = step
    return counters

"""Deep validation of one checkpoint: whole, loadable, finite, consistent, and good enough.

``format.verify`` proves the bytes are the ones the manifest lists (parallel
sha256). This module adds what only loading can tell: the DCP metadata reads,
every tensor loads on CPU and is finite, the rank files agree with the
manifest's world size, the step moves forward, and the metrics meet the
spec. One reason per problem; an empty list means valid.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from trainyard.checkpoint.format import read_manifest, verify
from trainyard.quality.metrics import History, metric_problems
from trainyard.spec import MetricExpectations

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp\Z")


@dataclass(frozen=True)
class Validation:
    path: Path
    step: int | None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "valid": self.valid, "problems": self.problems,
                "seconds": self.seconds}


def load_tensors(ckpt_dir: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, loaded on CPU without knowing the model (as ``dcp_to_torch_save`` does)."""
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        _load_state_dict(state, storage_reader=FileSystemReader(ckpt_dir), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state


def _tensors(value: Any, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{name}[{i}]")


def tensor_problems(ckpt_dir: Path) -> list[str]:
    """The checkpoint loads, and every floating-point tensor in it is finite."""
    # Any failure to read is the reason, whatever its type; DCP's own CheckpointException is a BaseException.
    try:
        FileSystemReader(ckpt_dir).read_metadata()
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        return [f"torch.distributed.checkpoint metadata is unreadable: {type(exc).__name__}: {exc}"]
    try:
        state = load_tensors(ckpt_dir)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        return [f"tensors do not load: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"]
    problems = []
    for name, tensor in _tensors(state):
        # A sum is NaN or Inf if any element is, at memory speed; only then (or on overflow) look closer.
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            problems.append(f"tensor {name} has {nan} NaN and {inf} Inf value(s)")
    return problems


def validate(
    ckpt_dir: str | Path,
    expect: MetricExpectations | None = None,
    history: History | None = None,
    after_step: int | None = None,
) -> Validation:
    """Every check on ``ckpt_dir``; ``after_step`` is the latest valid step it must follow."""
    started = time.monotonic()
    path = Path(ckpt_dir)
    problems = verify(path)  # manifest, version, sizes, hashes, unlisted files
    if problems:
        return Validation(path, None, problems, round(time.monotonic() - started, 3))
    manifest = read_manifest(path)
    step = int(manifest["step"])
    ranks = [int(m.group(1)) for p in path.iterdir() if (m := _RANK_FILE.match(p.name))]
    if any(rank >= manifest["world_size"] for rank in ranks):
        problems.append(f"rank files up to {max(ranks)} but the manifest says world size {manifest['world_size']}")
    if after_step is not None and step <= after_step:
        problems.append(f"step {step} does not follow the latest valid step {after_step}")
    problems += tensor_problems(path)
    if expect is not None:
        loss = manifest.get("metrics", {}).get("loss")
        problems += metric_problems(history or [(step, loss)], step, loss, expect)
    return Validation(path, step, problems, round(time.monotonic() - started, 3))

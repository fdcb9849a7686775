"""A real DCP checkpoint as several ranks save it, shared by the unit and integration tests of publishing."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from trainyard.checkpoint.format import step_dir, write_manifest


def save_as_ranks(root: Path, step: int, ranks: int) -> Path:
    """A real DCP checkpoint whose entries lie in one file per rank (``__<rank>_0.distcp``), as ``ranks`` ranks write it."""
    path = step_dir(root, step)
    state = {f"layer{i}": torch.full((16,), float(i + ranks)) for i in range(4)}
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=ranks), no_dist=True)
    md = pickle.loads((path / ".metadata").read_bytes())  # written by this test: trusted
    for info in md.storage_data.values():
        rank = int(info.relative_path.removesuffix(".distcp").rsplit("_", 1)[1])  # __0_<file>.distcp
        info.relative_path = f"__{rank}_0.distcp"
    for rank in range(1, ranks):
        (path / f"__0_{rank}.distcp").rename(path / f"__{rank}_0.distcp")
    (path / ".metadata").write_bytes(pickle.dumps(md))
    write_manifest(
        path, step=step, world_size=ranks, global_batch=8, micro_batch=2, metrics={"loss": 2.0}, run_id=f"ranks-{ranks}"
    )
    return path


def gate_passed(run: Any, folder: Path) -> str:
    """``folder`` as the run's gate leaves it for publishing: moved into the pipeline's root (over an earlier
    save of its step) and passed in the run's ledger with its manifest's digest (publish takes only that)."""
    import hashlib
    import shutil

    target = run.checkpoint_root / folder.name
    if target.exists():
        shutil.rmtree(target)
    run.checkpoint_root.mkdir(parents=True, exist_ok=True)
    folder.rename(target)
    digest = hashlib.sha256((target / "manifest.json").read_bytes()).hexdigest()
    run.ledger.append(
        "check_checkpoint",
        "checkpoint_checked",
        path=str(target),
        valid=True,
        problems=[],
        seconds=0.0,
        manifest_sha256=digest,
    )
    return str(target)

"""The corruption catalog: each way a checkpoint goes bad is caught with its reason."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainyard.checkpoint.format import MANIFEST, step_dir, write_manifest
from trainyard.checkpoint.validate import validate
from trainyard.spec import MetricExpectations


def save(root: Path, step: int, loss: float = 2.0, poison: float | None = None, world_size: int = 1) -> Path:
    """A real single-process DCP checkpoint with a manifest."""
    path = step_dir(root, step)
    weights = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    if poison is not None:
        weights[3, 3] = poison
    state = {"model": {"w": weights, "b": torch.zeros(8)}, "optim": {"step": torch.tensor(step)}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    write_manifest(
        path, step=step, world_size=world_size, global_batch=8, micro_batch=2, metrics={"loss": loss}, run_id="test"
    )
    return path


def tensor_file(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def edit_manifest(path: Path, **changes: object) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(changes)
    (path / MANIFEST).write_text(json.dumps(manifest))


def flip_byte(path: Path) -> None:
    f = tensor_file(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


CATALOG = [
    ("flipped-byte", flip_byte, "sha256 mismatch"),
    ("truncated-file", lambda p: tensor_file(p).write_bytes(tensor_file(p).read_bytes()[:100]), "size"),
    ("missing-file", lambda p: tensor_file(p).unlink(), "missing"),
    ("missing-manifest", lambda p: (p / MANIFEST).unlink(), "manifest"),
    ("truncated-manifest", lambda p: (p / MANIFEST).write_text((p / MANIFEST).read_text()[:40]), "manifest"),
    ("unknown-version", lambda p: edit_manifest(p, version=99), "version"),
    (
        "hash-mismatch",
        lambda p: edit_manifest(
            p, files={k: {**v, "sha256": "0" * 64} for k, v in json.loads((p / MANIFEST).read_text())["files"].items()}
        ),
        "sha256 mismatch",
    ),
    (
        "file-added-after-manifest",
        lambda p: (p / "extra.bin").write_bytes(b"late"),
        "extra.bin: not listed in the manifest",
    ),
]
# Unreadable DCP metadata needs a manifest that matches the bad .metadata: see its own test below.


@pytest.mark.parametrize("damage,reason", [(d, r) for _, d, r in CATALOG], ids=[c for c, _, _ in CATALOG])
def test_catalog(tmp_path: Path, damage, reason: str) -> None:
    path = save(tmp_path, 10)
    assert validate(path).valid
    damage(path)
    result = validate(path)
    assert not result.valid
    assert any(reason in p for p in result.problems), result.problems


@pytest.mark.parametrize("value,word", [(math.nan, "1 NaN and 0 Inf"), (math.inf, "0 NaN and 1 Inf")])
def test_non_finite_tensors(tmp_path: Path, value: float, word: str) -> None:
    result = validate(save(tmp_path, 10, poison=value))
    assert result.problems == [f"tensor model.w has {word} value(s)"]


def test_unreadable_dcp_metadata_with_a_matching_manifest(tmp_path: Path) -> None:
    path = save(tmp_path, 10)
    (path / ".metadata").write_bytes(b"not a pickle")
    write_manifest(path, step=10, world_size=1, global_batch=8, micro_batch=2, metrics={"loss": 2.0}, run_id="t")
    [problem] = validate(path).problems
    assert problem.startswith("torch.distributed.checkpoint metadata is unreadable")


def test_step_regression(tmp_path: Path) -> None:
    result = validate(save(tmp_path, 10), after_step=20)
    assert result.problems == ["step 10 does not follow the latest valid step 20"]


def test_world_size_must_cover_the_rank_files(tmp_path: Path) -> None:
    path = save(tmp_path, 10)
    tensor_file(path).rename(path / "__3_0.distcp")
    meta = json.loads((path / MANIFEST).read_text())
    write_manifest(path, step=10, world_size=2, global_batch=8, micro_batch=2, metrics={"loss": 2.0}, run_id="t")
    assert meta["world_size"] == 1
    assert any("rank files up to 3 but the manifest says world size 2" in p for p in validate(path).problems)


def test_metrics_out_of_bounds_and_spikes(tmp_path: Path) -> None:
    path = save(tmp_path, 30, loss=2.5)
    assert validate(path, MetricExpectations(max_loss=3.0)).valid
    [problem] = validate(path, MetricExpectations(max_loss=2.0)).problems
    assert problem == "loss 2.5000 at step 30 is above checkpoint.expectations.max_loss 2.0"
    history = [(s, 3.0) for s in range(1, 30)] + [(30, 2.5)]
    history[19] = (20, 50.0)
    [spike] = validate(path, MetricExpectations(), history).problems
    assert spike == "loss spiked above 3.0x its running median at step 20 (16.7x)"
    nan_loss = save(tmp_path / "n", 30, loss=math.nan)
    assert "loss at step 30 is nan, not a finite number" in validate(nan_loss, MetricExpectations()).problems


def test_a_copy_is_as_valid_as_the_original(tmp_path: Path) -> None:
    path = save(tmp_path, 10)
    shutil.copytree(path, tmp_path / "copy" / path.name)
    assert validate(tmp_path / "copy" / path.name).valid


def test_an_answer_left_unread_never_answers_the_next_checkpoint(tmp_path: Path) -> None:
    """The child loads while the manifest is hashed; when the hashes fail first, its answer is still
    read and dropped, so the next validation reads its own."""
    poisoned = save(tmp_path / "p", 10, poison=math.nan)
    (poisoned / "notes.txt").write_text("not in the manifest")  # the integrity check fails first
    result = validate(poisoned)
    assert result.problems and not any("NaN" in p for p in result.problems), result.problems
    assert validate(save(tmp_path / "ok", 20)).valid  # not the poisoned one's answer

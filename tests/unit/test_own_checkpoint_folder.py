"""A script's own checkpoint FOLDER, overwritten in place (issue 51, "what must be true" 5).

A script that keeps ``latest/`` (``model.pt`` and ``optim.pt``, only one of them holding the step) and writes
over it at every save: each completed overwrite is adopted as ONE save, a copy the next overwrite cannot
change, its step read from its files by the sandboxed inspector; a torn one waits; it is put back at its own
place before a resume, a link inside it is never written through; the gate validates it. A folder named with
its step (``checkpoint-120/``, ``step-120/``) is written once and still linked.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from test_final_checkpoint import SPEC, make_run
from test_own_checkpoint_file import SHAPE, aged

from trainyard.checkpoint import foreign, putback
from trainyard.checkpoint.format import read_manifest, verify
from trainyard.checkpoint.validate import inspector, validate
from trainyard.pipeline import lineage
from trainyard.pipeline.lineage import resume_point
from trainyard.pipeline.run import open_run
from trainyard.pipeline.train import _resume_target
from trainyard.recovery.state import Course


def save_latest(folder: Path, iter_num: int, by: float = 0.0) -> Path:
    """A script's save into ``folder``: the model in one file (no step), the optimizer and ``iter_num`` in another;
    aged past the settle time, so it is complete."""
    torch.manual_seed(iter_num)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pt")
    torch.save({"optimizer": opt.state_dict(), "iter_num": iter_num, "best_val_loss": 2.5}, folder / "optim.pt")
    for name in ("model.pt", "optim.pt"):
        aged(folder / name, by)
    return folder


def adopter(root: Path, save_folder: str | None = None) -> foreign.Adopter:
    adoption = foreign.Adoption(shape=lambda: SHAPE, step_reader=inspector().step_of, save_folder=save_folder)
    return foreign.Adopter(root, adoption, lambda c, s: None)


def test_each_completed_overwrite_of_latest_is_one_save_copied(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    latest = save_latest(root / "out" / "latest", 20)
    [found] = foreign.scan(root)  # one save, not one per file
    assert (found.kind, found.source, found.step, found.step_named) == ("torch_folder", "out/latest", None, False)
    assert inspector().step_of(latest) == 20  # from optim.pt: model.pt holds no step
    watcher = adopter(root)
    assert watcher.adopt() == [root / "step_000020"]
    first = root / "step_000020"
    manifest = read_manifest(first)
    assert (manifest["framework"], manifest["source"], sorted(manifest["files"])) == (
        "torch_folder", "out/latest", ["model.pt", "optim.pt"]
    )  # fmt: skip
    assert (first / "optim.pt").stat().st_ino != (latest / "optim.pt").stat().st_ino  # a copy, never a link
    before = (first / "model.pt").read_bytes()
    save_latest(latest, 40, by=40)  # the next save, over the same files
    assert watcher.adopt() == [root / "step_000040"]
    assert verify(first) == [] and (first / "model.pt").read_bytes() == before
    assert inspector().step_of(first) == 20 and inspector().step_of(root / "step_000040") == 40
    assert watcher.adopt() == []  # the same save is adopted once


def test_the_gate_validates_it_and_a_resume_loads_the_folder(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    save_latest(root / "latest", 20)
    [ckpt] = adopter(root).adopt()
    result = validate(ckpt)
    assert result.problems == [] and result.step == 20
    assert foreign.resume_file(ckpt) == ckpt
    with open(ckpt / "model.pt", "r+b") as f:  # the gate reads every torch file, not only the one with the step
        f.seek(60)
        f.write(b"\x00" * 16)
    assert validate(ckpt).problems


def test_a_torn_folder_is_not_adopted(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    latest = save_latest(root / "latest", 20)
    whole = (latest / "model.pt").read_bytes()
    (latest / "model.pt").write_bytes(whole[: len(whole) // 2])  # cut short: its zip end record is missing
    aged(latest / "model.pt")
    [found] = foreign.scan(root)
    assert "model.pt: no zip end record" in found.problem
    assert adopter(root).adopt() == [] and foreign.adopted(root) == {}


def test_the_spec_names_another_folder(tmp_path: Path) -> None:
    spec = tmp_path / "pipe.yaml"
    spec.write_text(SPEC.format(root=tmp_path).replace('checkpoints"}', 'checkpoints", save_folder: snapshot}'))
    run = open_run(spec, "pipe", "nightly__1", "2026-01-01")
    assert run.spec.checkpoint.save_folder == "snapshot"
    root = run.checkpoint_root
    save_latest(root / "snapshot", 30)
    assert {f.kind for f in foreign.scan(root)} == {"torch"}  # unnamed: each file is a save of its own
    [found] = foreign.scan(root, "snapshot")
    assert (found.kind, found.source) == ("torch_folder", "snapshot")
    watcher = foreign.Adopter(root, lineage.adoption(run, since_ns=0), lambda c, s: None)
    assert watcher.adopt() == [root / "step_000030"]


def test_a_common_name_holding_saves_named_with_their_step_is_a_parent(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    root.mkdir()
    parent = root / "checkpoint"
    parent.mkdir()
    torch.save({"w": torch.ones(2)}, parent / "step_120.pt")
    aged(parent / "step_120.pt")
    [found] = foreign.scan(root)
    assert (found.kind, found.source, found.step) == ("torch", "checkpoint/step_120.pt", 120)


def test_it_is_put_back_at_its_own_place_before_a_resume(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    root = run.checkpoint_root
    latest = save_latest(root / "out" / "latest", 20)
    good = {n: (latest / n).read_bytes() for n in ("model.pt", "optim.pt")}
    [ckpt] = adopter(root).adopt()
    (latest / "optim.pt").write_bytes(b"torn by the killed attempt")
    (latest / "model.pt").unlink()
    target = _resume_target(run, Course(["node-0"], 2, str(ckpt)))
    assert target == str(latest)
    assert {n: (latest / n).read_bytes() for n in good} == good
    assert inspector().step_of(latest) == 20 and verify(ckpt) == []


def test_a_link_inside_is_refused_at_adoption_and_replaced_not_written_through_on_put_back(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    latest = save_latest(root / "latest", 20)
    elsewhere = tmp_path / "elsewhere.pt"
    elsewhere.write_bytes(b"theirs")
    os.symlink(elsewhere, latest / "extra.pt")
    [found] = foreign.scan(root)
    assert "extra.pt is a link" in found.problem
    assert adopter(root).adopt() == []
    (latest / "extra.pt").unlink()
    [ckpt] = adopter(root).adopt()
    os.replace(latest / "model.pt", tmp_path / "moved.pt")
    os.symlink(elsewhere, latest / "model.pt")  # a rank plants a link where the script's file was
    assert putback.put_back(root, ckpt) == latest
    assert elsewhere.read_bytes() == b"theirs"
    assert not (latest / "model.pt").is_symlink() and verify(ckpt) == []


def test_a_folder_named_with_its_step_is_still_linked(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    for name in ("step-120", "checkpoint-120"):
        (root / name).mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, root / "checkpoint-120" / "optimizer.pt")
    (root / "checkpoint-120" / "trainer_state.json").write_text('{"global_step": 120}')
    (root / "checkpoint-120" / "model.safetensors").write_bytes(b"")  # found, refused on its weights later
    (root / "step-120" / ".metadata").write_bytes(b"meta")
    (root / "step-120" / "__0_0.distcp").write_bytes(b"data")
    found = {f.kind: f for f in foreign.scan(root)}
    assert found["hf"].step_named and found["dcp"].step_named
    ckpt = foreign.adopt(root, found["dcp"], SHAPE)
    assert (ckpt / "__0_0.distcp").stat().st_ino == (root / "step-120" / "__0_0.distcp").stat().st_ino

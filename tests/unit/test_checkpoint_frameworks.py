"""A checkpoint format is one registered record: adding DeepSpeed's ``global_stepN/`` is one ``Framework``.

The DeepSpeed record here is registered for the test only (``monkeypatch``), with real ``torch.save`` files
laid out as DeepSpeed writes them; scanning, adopting, resuming and the inspector then take it without any
other change, which is what the registry promises (docs/architecture.md, "add a checkpoint format").
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch

from trainyard.checkpoint import foreign, frameworks, saves, tensors
from trainyard.checkpoint.format import read_manifest
from trainyard.checkpoint.frameworks import FORMATS, Framework, Reading, zip_problems
from trainyard.checkpoint.validate import inspected_files

MODEL = "mp_rank_00_model_states.pt"


def _deepspeed(path: Path, names: frozenset[str]) -> Reading:
    if MODEL not in names:
        return Reading(f"no {MODEL} (save incomplete?)")
    return Reading(zip_problems(path, [n for n in names if n.endswith(".pt")]))


DEEPSPEED = Framework(
    "deepspeed", re.compile(r"global_step([0-9]+)\Z"), (), _deepspeed, "torch", (), ("module", "optimizer"),
    re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt\Z"),
    "DeepSpeed global_stepN/ folders (mp_rank_00_model_states.pt and each rank's optimizer states)",
)  # fmt: skip


def test_every_format_answers_every_question_and_is_a_folder_or_a_file() -> None:
    assert all(f.default is MISSING and f.default_factory is MISSING for f in fields(Framework))
    for name, fw in FORMATS.items():
        assert fw.name == name
        assert (fw.folder is None) == bool(fw.suffixes), name  # a folder save has no suffix; a file save has one
        assert fw.help in foreign.FORMATS_HELP  # the gate names every format it understands
    suffixes = [s for fw in FORMATS.values() for s in fw.suffixes]
    assert len(suffixes) == len(set(suffixes))  # a file is one format's


def test_a_file_is_recognised_by_its_formats_suffix_and_a_folder_by_its_name() -> None:
    assert frameworks.of_file("epoch=0-step=12.ckpt") is FORMATS["lightning"]
    assert frameworks.of_file("ckpt_000120.pth") is FORMATS["torch"]
    assert frameworks.of_file("notes.txt") is None
    assert frameworks.of_folder("checkpoint-40") == (FORMATS["hf"], 40)
    assert frameworks.of_folder("step-7") == (FORMATS["dcp"], 7)
    assert frameworks.of_folder("global_step7") is None


@pytest.fixture
def deepspeed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A lineage root holding a DeepSpeed save of step 7 by two ranks, an hour old (settled)."""
    monkeypatch.setitem(FORMATS, "deepspeed", DEEPSPEED)
    save = tmp_path / "root" / "ds" / "global_step7"
    save.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "global_steps": 7}, save / MODEL)
    for rank in (0, 1):
        torch.save({"optimizer": {"m": torch.zeros(2)}}, save / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    old = time.time() - 3600
    for p in (save, *save.iterdir()):
        os.utime(p, (old, old))
    return tmp_path / "root"


def test_a_registered_deepspeed_record_is_scanned_adopted_resumed_and_inspected(deepspeed: Path) -> None:
    [found] = saves.scan(deepspeed)
    assert (found.kind, found.step, found.problem, found.step_named) == ("deepspeed", 7, "", True)
    [ready] = foreign.adoptable(deepspeed, [found], {}, time.time_ns())
    shape = foreign.RunShape(world_size=1, global_batch=8, micro_batch=2, run_id="test")
    ckpt = foreign.adopt(deepspeed, ready, shape)
    manifest = read_manifest(ckpt)
    assert (manifest["framework"], manifest["step"], manifest["world_size"]) == ("deepspeed", 7, 2)
    assert foreign.framework(ckpt) == "deepspeed"
    assert foreign.resume_file(ckpt) == ckpt  # a folder format resumes from the folder
    files = inspected_files(manifest["files"], "deepspeed")
    assert files == sorted(manifest["files"])
    answer = tensors.inspect(ckpt, fmt="deepspeed", files=files)
    assert answer["problems"] == [] and set(answer["digests"]) == set(files)


def test_the_inspector_checks_only_the_keys_its_format_says_must_be_finite(deepspeed: Path) -> None:
    save = deepspeed / "ds" / "global_step7"
    torch.save({"module": {"w": torch.tensor([float("nan")])}}, save / MODEL)
    torch.save({"module": {}, "callbacks": {"x": torch.tensor([float("inf")])}}, save / "other.pt")
    answer = tensors.inspect(save, fmt="deepspeed", files=[MODEL, "other.pt"])
    assert answer["problems"] == [f"tensor {MODEL}.module.w has 1 NaN and 0 Inf value(s)"]


def test_a_half_written_save_of_a_registered_format_says_why_it_is_not_complete(deepspeed: Path) -> None:
    (deepspeed / "ds" / "global_step7" / MODEL).unlink()
    [found] = saves.scan(deepspeed)
    assert found.problem == f"no {MODEL} (save incomplete?)"
    assert foreign.adoptable(deepspeed, [found], {}, time.time_ns()) == []

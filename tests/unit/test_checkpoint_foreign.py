"""A user's own trainer saves the way its framework does, and trainyard understands it (issue 31, item 3).

Every save here is real: a Hugging Face ``Trainer`` run of a tiny GPT-2 with ``save_steps``, a Lightning
``ModelCheckpoint``, a ``torch.save`` file, a ``torch.distributed.checkpoint`` folder. The Hugging Face and
Lightning runs are made once per module (seconds each) and copied into each test's root.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_untrusted import RunsCode, touch_marker
from test_final_checkpoint import make_run

from trainyard.checkpoint import foreign, registry, safetensor
from trainyard.checkpoint.format import latest_valid, read_manifest, verify
from trainyard.checkpoint.validate import inspector, validate
from trainyard.errors import CheckpointInvalid
from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger
from trainyard.pipeline import stages
from trainyard.pipeline.lineage import resume_point

SHAPE = foreign.RunShape(world_size=1, global_batch=8, micro_batch=2, run_id="test")
OLD = time.time() - 3600  # saves an hour old: settled at any sweep


def _age(path: Path) -> Path:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (OLD, OLD), follow_symlinks=False)
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real saves: ``hf/checkpoint-{1,2}`` (Trainer, 2 steps, save_steps=1) and ``lightning/*.ckpt``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("made")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(4)]
    args = TrainingArguments(
        output_dir=str(out / "hf"), max_steps=2, save_steps=1, per_device_train_batch_size=2, use_cpu=True,
        report_to=[], logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data).train()

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self, lr: float = 0.1):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, _):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)

    ckpt = ModelCheckpoint(dirpath=out / "lightning", save_last=True, every_n_train_steps=1, save_top_k=-1)
    L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ckpt],
    ).fit(Tiny())  # fmt: skip
    return out


def hf_save(made: Path, root: Path, step: int = 2) -> Path:
    dst = root / "hf" / f"checkpoint-{step}"
    shutil.copytree(made / "hf" / f"checkpoint-{step}", dst)
    return _age(dst)


def lightning_saves(made: Path, root: Path) -> Path:
    dst = root / "lightning"
    shutil.copytree(made / "lightning", dst)
    return _age(dst)


def torch_save(path: Path, value: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(value, path)
    return _age(path)


def dcp_save(path: Path) -> Path:
    dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=path, no_dist=True)
    return _age(path)


def adopt_one(root: Path, source: str) -> Path:
    [found] = [f for f in foreign.scan(root) if f.source == source]
    return foreign.adopt(root, found, SHAPE)


def test_each_format_is_recognized_with_its_step(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    hf_save(made, root)
    lightning_saves(made, root)
    torch_save(root / "ckpt_000007.pt", {"w": torch.ones(2)})
    dcp_save(root / "dcp" / "step-5")
    (root / "step_000001").mkdir()  # trainyard's own folders are never foreign saves
    torch_save(root / "superseded" / "step_000003-1" / "x_000003.pt", {"w": torch.ones(1)})
    torch_save(root / "step_000009.tmp" / "y_000009.pt", {"w": torch.ones(1)})
    torch_save(root / "a" / "b" / "c" / "d" / "deep_000011.pt", {"w": torch.ones(1)})  # four deep: not searched
    torch_save(root / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=3.ckpt", {"global_step": 3})

    found = {f.source: f for f in foreign.scan(root)}
    assert {s: (f.kind, f.step, f.complete) for s, f in found.items()} == {
        "hf/checkpoint-2": ("hf", 2, True),
        "lightning/epoch=0-step=1.ckpt": ("lightning", 1, True),
        "lightning/epoch=0-step=2.ckpt": ("lightning", 2, True),
        "lightning/last.ckpt": ("lightning", None, True),  # its step is inside it: the inspector reads it
        "ckpt_000007.pt": ("torch", 7, True),
        "lightning_logs/version_0/checkpoints/epoch=0-step=3.ckpt": ("lightning", 3, True),  # Lightning's default
        "dcp/step-5": ("dcp", 5, True),
    }
    assert set(found["hf/checkpoint-2"].metrics) == {"loss"}  # the last logged loss, from trainer_state.json
    assert inspector().step_of(root / "lightning" / "last.ckpt") == 2  # global_step, loaded weights-only


def test_an_hf_folder_names_its_step_by_trainer_state(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    folder = hf_save(made, root)
    folder.rename(root / "hf" / "checkpoint-99")  # a renamed folder: trainer_state.json's global_step decides
    [found] = foreign.scan(root)
    assert found.step == 2


def test_incomplete_saves_are_found_but_never_adopted(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    folder = hf_save(made, root)
    (folder / "trainer_state.json").unlink()  # the Trainer writes it after the weights
    cut = torch_save(root / "ckpt_000004.pt", {"w": torch.ones(1000)})
    with open(cut, "r+b") as fh:
        fh.truncate(cut.stat().st_size // 2)
    _age(cut)
    (root / "dcp" / "step-6").mkdir(parents=True)
    problems = {f.source: f.problem for f in foreign.scan(root)}
    assert problems == {
        "hf/checkpoint-2": "no trainer_state.json (save incomplete?)",
        "ckpt_000004.pt": problems["ckpt_000004.pt"],
        "dcp/step-6": "no .metadata (save incomplete?)",
    }
    assert problems["ckpt_000004.pt"].startswith("ckpt_000004.pt: no zip end record")
    assert foreign.adoptable(root, foreign.scan(root), {}, time.time_ns()) == []


def test_a_fresh_save_is_adopted_once_it_stops_changing(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    root.mkdir()
    torch.save({"w": torch.ones(2)}, root / "ckpt_000003.pt")  # written just now
    first = foreign.scan(root)
    assert foreign.adoptable(root, first, {}, time.time_ns()) == []  # too fresh to call done
    seen = {f.source: f.signature for f in first}
    [ready] = foreign.adoptable(root, foreign.scan(root), seen, time.time_ns())  # unchanged since the last scan
    assert ready.step == 3
    torch.save({"w": torch.ones(3)}, root / "ckpt_000003.pt")  # written again: not the save the scan saw
    assert foreign.adoptable(root, foreign.scan(root), seen, time.time_ns()) == []


def test_links_are_never_followed(made: Path, tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "pipe", tmp_path / "elsewhere"
    root.mkdir()
    secret = torch_save(elsewhere / "ckpt_000050.pt", {"w": torch.ones(1)})
    hf = hf_save(made, elsewhere)
    (root / "ckpt_000050.pt").symlink_to(secret)
    (root / "hf").symlink_to(hf.parent)
    (root / "checkpoint-3").symlink_to(hf)
    inside = hf_save(made, root / "mine")
    (inside / "pytorch_model.bin").symlink_to(secret)
    [found] = foreign.scan(root)
    assert found.source == "mine/hf/checkpoint-2"
    assert found.problem == "pytorch_model.bin is a link or not a regular file; a checkpoint holds regular files only"


def test_adoption_links_the_files_keeps_the_users_and_happens_once(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    folder = hf_save(made, root)
    before = {p.name: (p.stat().st_size, p.read_bytes()) for p in folder.iterdir()}
    ckpt = adopt_one(root, "hf/checkpoint-2")

    assert ckpt == root / "step_000002" and verify(ckpt) == []
    manifest = read_manifest(ckpt)
    assert (manifest["framework"], manifest["source"], manifest["step"]) == ("hf", "hf/checkpoint-2", 2)
    assert manifest["metrics"]["loss"] > 0 and manifest["world_size"] == 1
    assert (ckpt / "model.safetensors").stat().st_ino == (folder / "model.safetensors").stat().st_ino  # linked
    assert {p.name: (p.stat().st_size, p.read_bytes()) for p in folder.iterdir()} == before  # the user's, as they were

    assert adopt_one(root, "hf/checkpoint-2") == ckpt  # again: the same checkpoint, nothing new
    assert foreign.adoptable(root, foreign.scan(root), {}, time.time_ns()) == []
    assert sorted(p.name for p in root.iterdir()) == ["hf", "step_000002"]

    shutil.rmtree(folder)  # the Trainer's save_total_limit rotates its folder away
    assert verify(ckpt) == []  # the links keep the adopted bytes


def test_an_adopted_save_set_aside_is_not_adopted_again(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    hf_save(made, root)
    ckpt = adopt_one(root, "hf/checkpoint-2")
    registry.set_aside(root, None)  # a fresh start of the lineage moves it aside
    assert not ckpt.exists()
    assert foreign.adoptable(root, foreign.scan(root), {}, time.time_ns()) == []


def test_hf_save_validates_and_notes_what_cannot_be_inspected(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    hf_save(made, root)
    result = validate(adopt_one(root, "hf/checkpoint-2"))
    assert result.valid, result.problems
    # numpy's RNG state and the TrainingArguments object need full unpickling: never done, only noted.
    assert {n.split(":")[0] for n in result.notes} == {"rng_state.pth", "training_args.bin"}
    assert all("accepted on its hash" in n for n in result.notes)


def _poison_safetensors(path: Path) -> None:
    """A NaN in the first float32 of the file's first tensor, the header left as it is."""
    raw = bytearray(path.read_bytes())
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    begin = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    raw[8 + length + begin : 8 + length + begin + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(raw))


def test_a_nan_in_safetensors_is_caught_without_torch(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    folder = hf_save(made, root)
    _poison_safetensors(folder / "model.safetensors")
    _age(folder)
    result = validate(adopt_one(root, "hf/checkpoint-2"))
    [problem] = result.problems
    assert problem.startswith("model.safetensors: tensor ") and problem.endswith("has 1 NaN and 0 Inf value(s)")


def test_a_safetensors_file_that_does_not_cover_its_data_is_refused(made: Path, tmp_path: Path) -> None:
    src = made / "hf" / "checkpoint-2" / "model.safetensors"
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(src.read_bytes()[:-4])
    assert safetensor.problems(src) == []
    [problem] = safetensor.problems(cut)
    assert "cut short or trailing bytes" in problem
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert "does not fit" in safetensor.problems(bad)[0]


def test_a_nan_in_a_torch_save_is_caught_in_the_sandbox(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    torch_save(root / "ckpt_000003.pt", {"model": {"w": torch.tensor([1.0, float("nan")])}, "step": 3})
    result = validate(adopt_one(root, "ckpt_000003.pt"))
    assert result.problems == ["tensor ckpt_000003.pt.model.w has 1 NaN and 0 Inf value(s)"]


def test_a_torch_save_whose_pickle_runs_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    root, marker = tmp_path / "pipe", tmp_path / "marker"
    evil = RunsCode(os.system, f'{sys.executable} -c "{touch_marker(marker)}"')
    torch_save(root / "ckpt_000003.pt", {"w": torch.ones(2), "x": evil})
    ckpt = adopt_one(root, "ckpt_000003.pt")
    result = validate(ckpt)
    assert inspector().step_of(ckpt / "ckpt_000003.pt") is None
    assert not marker.exists(), "the checkpoint's pickle ran"
    [problem] = result.problems
    assert "calls posix.system" in problem and "refused, never loaded" in problem


def test_a_dcp_folder_validates_like_trainyards_own(tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    dcp_save(root / "dcp" / "step-5")
    ckpt = adopt_one(root, "dcp/step-5")
    assert validate(ckpt).problems == []
    assert foreign.resume_file(ckpt) == ckpt


def test_the_watcher_adopts_lightning_saves_once_each_and_promotes_them(made: Path, tmp_path: Path) -> None:
    root = tmp_path / "pipe"
    lightning_saves(made, root)
    ledger = Ledger(tmp_path / "events.jsonl")
    adoption = foreign.Adoption(shape=lambda: SHAPE, step_reader=inspector().step_of)
    with registry.Watcher(
        root, lambda p, after: validate(p, after_step=after), ledger, keep=1, poll_s=3600, adoption=adoption
    ) as watcher:
        watcher.sweep()
        watcher.sweep()  # step_000001 retired (keep 1) by now: its save is older than the lineage, not new
    adopted = [(e["source"], e["step"]) for e in ledger.events("train", "checkpoint_adopted")]
    # last.ckpt holds step 2, as epoch=0-step=2.ckpt does: the name that carries the step is the one taken.
    assert adopted == [("lightning/epoch=0-step=1.ckpt", 1), ("lightning/epoch=0-step=2.ckpt", 2)]
    assert all(r.valid for r in watcher.results) and registry.latest(root) == root / "step_000002"
    assert [e["step"] for e in ledger.events("train", "checkpoint_retired")] == [1]
    assert not (root / "step_000001").exists() and (root / "lightning" / "epoch=0-step=1.ckpt").is_file()
    rows = {r.name: r for r in fold(ledger.events()).checkpoints}
    assert rows["step_000002"].saved_at is not None and "promoted" in rows["step_000002"].fate
    assert rows["step_000002"].fate[0] == "adopted from lightning/epoch=0-step=2.ckpt (lightning)"
    assert foreign.resume_file(root / "step_000002") == root / "step_000002" / "epoch=0-step=2.ckpt"


def test_the_gate_adopts_the_final_save_and_passes_it(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    for step in (10, 20):  # written after the run's resume point, the last just before the gate looks
        (run.checkpoint_root / "torch").mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.ones(2), "step": step}, run.checkpoint_root / "torch" / f"ckpt_{step:06d}.pt")
        run.ledger.append("train", "step", step=step, loss=2.0)
    torch_save(run.checkpoint_root / "old" / "ckpt_000030.pt", {"w": torch.ones(2)})  # an hour old: not this run's
    result = stages.check_checkpoint(run, None, 20)
    assert (result.step, result.checkpoint) == (20, str(run.checkpoint_root / "step_000020"))
    adopted = [e["source"] for e in run.ledger.events("train", "checkpoint_adopted")]
    assert adopted == ["torch/ckpt_000010.pt", "torch/ckpt_000020.pt"]


def test_the_gate_says_what_a_valid_checkpoint_is_and_why_each_save_was_refused(made: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    resume_point(run)
    folder = hf_save(made, run.checkpoint_root, step=2)
    (folder / "trainer_state.json").unlink()
    with pytest.raises(CheckpointInvalid) as caught:
        stages.check_checkpoint(run, None, 20)
    message = str(caught.value)
    assert "hf/checkpoint-2 (hf, step 2): no trainer_state.json (save incomplete?)" in message
    for fmt in ("Hugging Face Trainer checkpoint-N/", "Lightning", "torch.save", "step-N/", "TRAINYARD_CHECKPOINT_DIR"):
        assert fmt in message


def test_the_next_night_resumes_from_the_adopted_save(made: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path, "nightly__1")
    hf_save(made, run.checkpoint_root, step=2)
    resumed, start = resume_point(run)
    assert (resumed, start) == (str(run.checkpoint_root / "step_000002"), 2)  # the run trains to 2 + max_steps
    assert latest_valid(run.checkpoint_root) == run.checkpoint_root / "step_000002"
    assert foreign.resume_file(Path(resumed)) == Path(resumed)  # Hugging Face resumes from the folder
    [adopted] = run.ledger.events("train", "checkpoint_adopted")
    assert adopted["framework"] == "hf"


def test_a_file_rewritten_in_place_is_copied_not_linked(tmp_path: Path) -> None:
    """``latest.pt`` (no step in its name) is rewritten by the next save: a link would change the adopted bytes."""
    root = tmp_path / "pipe"
    saved = torch_save(root / "latest.pt", {"w": torch.ones(2), "step": 4})
    [found] = foreign.adoptable(root, foreign.scan(root), {}, time.time_ns(), step_reader=inspector().step_of)
    ckpt = foreign.adopt(root, found, SHAPE)
    assert ckpt == root / "step_000004"
    assert (ckpt / "latest.pt").stat().st_ino != saved.stat().st_ino
    torch.save({"w": torch.zeros(2), "step": 5}, saved)  # the framework's next save, over the same name
    assert verify(ckpt) == []
    assert foreign.resume_file(ckpt) == ckpt / "latest.pt"

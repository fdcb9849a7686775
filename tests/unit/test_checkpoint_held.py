"""The orchestrator writes in a lineage root (which its ranks write) only through held folder handles (issue 49).

Each test plays the hostile rank with real files and real links: a staging folder swapped for a link while
files are brought in, a ``quarantine`` planted as a link, a source folder swapped for a link after the scan,
a scan of a root stuffed with folders, names that carry a newline. Every swap is done deterministically (a
link planted before the call, or at the moment the orchestrator links a file in).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from trainyard.checkpoint import foreign, registry, saves
from trainyard.checkpoint.format import list_checkpoints, read_manifest, verify
from trainyard.errors import CheckpointInvalid

SHAPE = foreign.RunShape(world_size=1, global_batch=8, micro_batch=2, run_id="test")
OLD = time.time() - 3600  # settled at any sweep


def _dcp_save(root: Path, step: int, where: str = "dcp", payload: bytes = b"rank zero's tensors") -> Path:
    """A complete torch.distributed.checkpoint folder as torchtitan writes it (``.metadata`` + one file a rank)."""
    folder = root / where / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"metadata")
    (folder / "__0_0.distcp").write_bytes(payload)
    for p in [*folder.iterdir(), folder]:
        os.utime(p, (OLD, OLD))
    return folder


def _found(root: Path, step: int) -> saves.Found:
    [found] = [f for f in foreign.scan(root) if f.step == step]
    assert found.complete, found.problem
    return found


def _everything(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def test_adoption_staging_swapped_for_a_link_writes_nowhere_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank swaps ``step_N.tmp`` for a link to another pipeline's root at the moment the orchestrator links
    the first file in: nothing lands in the other root, and nothing is committed there or here."""
    root, other = tmp_path / "mine", tmp_path / "theirs"
    other.mkdir()
    _dcp_save(root, 999)
    found = _found(root, 999)
    real_link, swapped = os.link, []

    def swap_then_link(*args, **kwargs):  # the rank's move, between the staging folder's making and its use
        if not swapped:
            os.rename(root / "step_000999.tmp", root / "moved-away")
            os.symlink(other, root / "step_000999.tmp")
            swapped.append(True)
        return real_link(*args, **kwargs)

    monkeypatch.setattr(os, "link", swap_then_link)
    with pytest.raises((CheckpointInvalid, OSError)):
        foreign.adopt(root, found, SHAPE)
    assert swapped
    assert _everything(other) == set(), "the orchestrator wrote through the rank's link"
    assert list_checkpoints(root) == []


def test_adoption_through_a_planted_staging_link_leaves_its_target_alone(tmp_path: Path) -> None:
    """``step_N.tmp`` already a link (to a folder holding a file) before adoption: the link is removed, its
    target and what it holds stay, and the save is adopted into a folder of its own."""
    root, other = tmp_path / "mine", tmp_path / "theirs"
    other.mkdir()
    (other / "keep.bin").write_bytes(b"theirs")
    _dcp_save(root, 7)
    (root / "step_000007.tmp").symlink_to(other)
    ckpt = foreign.adopt(root, _found(root, 7), SHAPE)
    assert (other / "keep.bin").read_bytes() == b"theirs" and _everything(other) == {"keep.bin"}
    assert not ckpt.is_symlink() and verify(ckpt) == []
    assert read_manifest(ckpt)["files"].keys() == {".metadata", "__0_0.distcp"}


def test_adopted_source_folder_swapped_for_a_link_after_the_scan_is_not_followed(tmp_path: Path) -> None:
    """After the scan, the save's parent folder ``dcp/`` becomes a link to a decoy outside the run holding
    files of the same names, sizes and times: the decoy's bytes are never adopted (O_NOFOLLOW at every
    level of the source path, not only the last)."""
    root, outside = tmp_path / "mine", tmp_path / "outside"
    _dcp_save(root, 5, payload=b"A" * 32)
    found = _found(root, 5)
    decoy = _dcp_save(outside, 5, where="decoy", payload=b"B" * 32)  # same size and mtime, other bytes
    os.rename(root / "dcp", tmp_path / "real-dcp")
    os.symlink(decoy.parent, root / "dcp")
    with pytest.raises(CheckpointInvalid, match="link"):
        foreign.adopt(root, found, SHAPE)
    assert list_checkpoints(root) == []


def test_adoption_still_links_a_save_in_and_commits_it(tmp_path: Path) -> None:
    """The held-handle path adopts as before: files hard-linked (same inode), manifest last, verified."""
    root = tmp_path / "root"
    save = _dcp_save(root, 3)
    ckpt = foreign.adopt(root, _found(root, 3), SHAPE)
    assert ckpt == root / "step_000003" and verify(ckpt) == []
    assert (ckpt / "__0_0.distcp").stat().st_ino == (save / "__0_0.distcp").stat().st_ino
    assert read_manifest(ckpt)["source"] == "dcp/step-3"
    assert not (root / "step_000003.tmp").exists()


def test_quarantine_planted_as_a_link_moves_nothing_into_its_target(tmp_path: Path) -> None:
    """``quarantine`` planted as a link to another pipeline's root: refused, the invalid checkpoint stays in
    its own root, the other root stays empty."""
    root, other = tmp_path / "mine", tmp_path / "theirs"
    other.mkdir()
    bad = root / "step_000999"
    bad.mkdir(parents=True)
    (bad / "model.bin").write_bytes(b"x")
    (root / registry.QUARANTINE).symlink_to(other)
    with pytest.raises(OSError, match="link"):
        registry.quarantine(root, bad, ["corrupt"])
    assert _everything(other) == set()
    assert bad.is_dir() and (bad / "model.bin").exists()


def test_quarantine_records_where_the_folder_really_went(tmp_path: Path) -> None:
    root = tmp_path / "root"
    bad = root / "step_000020"
    bad.mkdir(parents=True)
    moved = registry.quarantine(root, bad, ["corrupt"])
    assert moved.parent == root / registry.QUARANTINE and not moved.parent.is_symlink()
    assert (moved / registry.REASONS).is_file() and not bad.exists()


def test_adoption_scan_stops_at_its_cap_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A root stuffed with empty folders costs a bounded walk per sweep, and says so, not unbounded CPU."""
    root = tmp_path / "root"
    for i in range(300):
        (root / f"junk{i:04d}" / "deeper").mkdir(parents=True)
    monkeypatch.setattr(saves, "SCAN_ENTRIES", 100, raising=False)
    listed: list[int] = []
    real_scandir = os.scandir

    class Counting:  # how many entries the scan is handed, whatever it does with them
        def __init__(self, path):
            self.it = real_scandir(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            for entry in self.it:
                listed.append(1)
                yield entry

    def counting(path):
        return Counting(path)

    monkeypatch.setattr(os, "scandir", counting)
    with caplog.at_level(logging.WARNING):
        assert foreign.scan(root) == []
    assert len(listed) <= 101 + 1, f"walked {len(listed)} entries past a cap of 100"
    assert any("entries" in r.getMessage() and "cap" in r.getMessage() for r in caplog.records)


EVIL = "x\nprogress: step 999 loss 0.0"


def test_rank_chosen_folder_name_reaches_the_adoption_warning_as_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A save under a folder whose name holds a newline, that cannot be adopted: the warning is one line."""
    root = tmp_path / "root"
    _dcp_save(root, 4, where=EVIL)

    def refuse(*_args, **_kwargs):
        raise CheckpointInvalid("changed since it was scanned")

    monkeypatch.setattr(foreign, "adopt", refuse)
    adopter = foreign.Adopter(root, foreign.Adoption(shape=lambda: SHAPE), lambda *_: None)
    with caplog.at_level(logging.WARNING):
        assert adopter.adopt() == []
    [warning] = [r.getMessage() for r in caplog.records if "cannot adopt" in r.getMessage()]
    assert "\n" not in warning and "x\\nprogress" in warning


def test_rank_chosen_folder_name_reaches_the_gate_message_as_one_line(tmp_path: Path) -> None:
    """``explain`` (what the gate's ``why_none`` lists of what it found) shows a newline escaped."""
    root = tmp_path / "root"
    (root / EVIL / "step-6").mkdir(parents=True)  # incomplete: no .metadata
    lines = foreign.explain(root)
    assert lines and all("\n" not in line for line in lines)
    assert any("x\\nprogress" in line for line in lines)


def test_rank_chosen_file_names_in_refusals_reach_why_none_as_one_line(tmp_path: Path) -> None:
    """A refused checkpoint's problems name the rank's files (a name with a newline): the gate's message
    (``why_none``) keeps each on one line, so a forged ``progress:`` line never appears in the task log."""
    from test_final_checkpoint import make_run

    from trainyard.pipeline.lineage import why_none

    run = make_run(tmp_path, "r1")
    run.ledger.append(
        "train",
        "checkpoint_validated",
        path=str(run.checkpoint_root / "step_000010"),
        step=10,
        valid=False,
        problems=[f"{EVIL}.bin: sha256 mismatch (contents changed after the save)"],
    )
    message = why_none(run)
    assert "\n" not in message and "x\\nprogress: step 999" in message


def test_rank_chosen_file_names_reach_the_quarantine_warning_and_ledger_as_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from trainyard.events.ledger import Ledger

    root, ledger = tmp_path / "root", Ledger.in_dir(tmp_path)
    bad = root / "step_000020"
    bad.mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        registry.quarantine(root, bad, [f"{EVIL}.bin: missing"], ledger)
    [warning] = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert "\n" not in warning and "x\\nprogress" in warning
    [event] = ledger.events("train", "checkpoint_quarantined")
    assert all("\n" not in p for p in event["problems"])

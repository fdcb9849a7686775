"""The checkpoint directory format: manifest, integrity check, discovery and safe commit."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trainyard.checkpoint import format as fmt
from trainyard.errors import CheckpointInvalid

FIELDS = {"world_size": 2, "global_batch": 32, "micro_batch": 8, "metrics": {"loss": 2.5}, "run_id": "r1"}


def _write_files(directory: Path, marker: str = "a") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".metadata").write_bytes(b"meta-" + marker.encode())
    (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (directory / "__1_0.distcp").write_bytes(marker.encode() * 100)
    (directory / "extra").mkdir(exist_ok=True)
    (directory / "extra" / "rng.bin").write_bytes(b"rng")


def make_checkpoint(root: Path, step: int, marker: str = "a") -> Path:
    """A committed checkpoint built the way the trainer builds one: stage, manifest, commit."""
    staging = fmt.prepare_staging(root, step)
    _write_files(staging, marker)
    fmt.write_manifest(staging, step=step, **FIELDS)
    return fmt.commit(staging, root, step)


def test_step_dir_naming(tmp_path: Path) -> None:
    assert fmt.step_dir(tmp_path, 120) == tmp_path / "step_000120"
    assert fmt.staging_dir(tmp_path, 120) == tmp_path / "step_000120.tmp"
    assert fmt.step_of(tmp_path / "step_000120") == 120
    assert fmt.step_of(tmp_path / "step_000120.tmp") is None


def test_manifest_roundtrip(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 120)
    manifest = fmt.read_manifest(ckpt)

    assert manifest["format"] == "trainyard.checkpoint" and manifest["version"] == 1
    assert {k: manifest[k] for k in FIELDS} == FIELDS
    assert manifest["step"] == 120
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "extra/rng.bin"}
    assert manifest["files"]["__0_0.distcp"]["size"] == 2048
    assert manifest["files"]["__0_0.distcp"]["sha256"] == fmt.sha256_file(ckpt / "__0_0.distcp")
    assert fmt.verify(ckpt) == []
    assert not list(ckpt.glob("*.tmp"))  # the manifest's temporary name is gone


def test_sha256_streams_files_larger_than_one_block(tmp_path: Path) -> None:
    import hashlib

    big = tmp_path / "big"
    data = bytes(range(256)) * (5 * 4096 + 3)  # > 5 MiB, not a multiple of the block size
    big.write_bytes(data)
    assert fmt.sha256_file(big) == hashlib.sha256(data).hexdigest()


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda d: _flip_byte(d / "__0_0.distcp"), "__0_0.distcp: sha256 mismatch"),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:-10]),
            "__0_0.distcp: size mismatch",
        ),
        (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp: missing"),
        (lambda d: (d / "extra" / "rng.bin").unlink(), "extra/rng.bin: missing"),
        (lambda d: (d / "stray.distcp").write_bytes(b"x"), "stray.distcp: not listed in the manifest"),
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
    ],
    ids=["flipped-byte", "truncated", "missing-file", "missing-nested", "unlisted", "no-manifest", "bad-json"],
)
def test_verify_reports_damage(tmp_path: Path, damage, expected: str) -> None:
    ckpt = make_checkpoint(tmp_path, 10)
    damage(ckpt)
    problems = fmt.verify(ckpt)
    assert len(problems) == 1, problems
    assert expected in problems[0]


def _edit_manifest(ckpt: Path, **changes: object) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.update(changes)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"version": 2}, "version 2 is not supported"),
        ({"format": "other"}, "format 'other'"),
        ({"files": None}, "'files' missing"),
    ],
)
def test_read_manifest_rejects_unknown_or_malformed(tmp_path: Path, changes: dict, expected: str) -> None:
    ckpt = make_checkpoint(tmp_path, 10)
    _edit_manifest(ckpt, **changes)
    with pytest.raises(CheckpointInvalid, match=expected):
        fmt.read_manifest(ckpt)
    assert any(expected in p for p in fmt.verify(ckpt))


def test_read_manifest_missing_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointInvalid, match="no manifest.json"):
        fmt.read_manifest(tmp_path)


def test_verify_catches_step_that_disagrees_with_directory_name(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path, 10)
    _edit_manifest(ckpt, step=20)
    assert fmt.verify(ckpt) == ["manifest step 20 does not match directory name step_000010"]


def test_verify_rejects_manifest_paths_outside_the_checkpoint(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "root", 10)
    (tmp_path / "outside").write_bytes(b"x")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["../../outside"] = {"size": 1, "sha256": fmt.sha256_file(tmp_path / "outside")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert fmt.verify(ckpt) == ["../../outside: path escapes the checkpoint directory"]


def test_list_checkpoints_only_committed_sorted_by_step(tmp_path: Path) -> None:
    for step in (1_000_000, 20, 100):
        make_checkpoint(tmp_path, step)
    _write_files(fmt.staging_dir(tmp_path, 200))  # a save in progress
    _write_files(tmp_path / "step_000300")  # files but no manifest: not a checkpoint
    (tmp_path / "notes").mkdir()
    make_checkpoint(tmp_path, 20, marker="b")  # supersedes step 20 into superseded/

    assert fmt.list_checkpoints(tmp_path) == [
        tmp_path / "step_000020",
        tmp_path / "step_000100",
        tmp_path / "step_1000000",
    ]
    assert fmt.list_checkpoints(tmp_path / "does-not-exist") == []


def test_latest_valid_skips_invalid_newer_checkpoints(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        make_checkpoint(tmp_path, step)
    _flip_byte(fmt.step_dir(tmp_path, 30) / "__0_0.distcp")
    (fmt.step_dir(tmp_path, 20) / "__1_0.distcp").unlink()
    skipped: list[tuple[Path, list[str]]] = []

    latest = fmt.latest_valid(tmp_path, on_invalid=lambda path, problems: skipped.append((path, problems)))

    assert latest == fmt.step_dir(tmp_path, 10)
    assert [p.name for p, _ in skipped] == ["step_000030", "step_000020"]
    assert "sha256 mismatch" in skipped[0][1][0]


def test_latest_valid_none_when_nothing_valid(tmp_path: Path) -> None:
    assert fmt.latest_valid(tmp_path) is None
    make_checkpoint(tmp_path, 10)
    (fmt.step_dir(tmp_path, 10) / "manifest.json").write_text("{}")
    assert fmt.latest_valid(tmp_path) is None


def test_resave_moves_existing_step_to_superseded(tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path, 50, marker="old")
    old_manifest = fmt.read_manifest(first)

    second = make_checkpoint(tmp_path, 50, marker="new")
    third = make_checkpoint(tmp_path, 50, marker="newest")  # same second: both old copies kept

    assert second == third == fmt.step_dir(tmp_path, 50)
    assert (third / ".metadata").read_bytes() == b"meta-newest"
    moved = sorted((tmp_path / "superseded").iterdir())
    assert len(moved) == 2
    assert all(p.name.startswith("step_000050-") for p in moved)
    contents = {(p / ".metadata").read_bytes() for p in moved}
    assert contents == {b"meta-old", b"meta-new"}
    old_copy = next(p for p in moved if (p / ".metadata").read_bytes() == b"meta-old")
    assert fmt.read_manifest(old_copy) == old_manifest
    assert fmt.verify(old_copy) == []  # moved intact, still a usable checkpoint
    assert not fmt.staging_dir(tmp_path, 50).exists()


def test_prepare_staging_clears_a_stale_save(tmp_path: Path) -> None:
    stale = fmt.staging_dir(tmp_path, 5)
    _write_files(stale)
    staging = fmt.prepare_staging(tmp_path, 5)
    assert staging == stale and list(staging.iterdir()) == []


def test_commit_refuses_staging_without_manifest(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 5)
    staging = fmt.prepare_staging(tmp_path, 5)
    _write_files(staging)
    with pytest.raises(CheckpointInvalid, match="without manifest.json"):
        fmt.commit(staging, tmp_path, 5)
    assert fmt.verify(fmt.step_dir(tmp_path, 5)) == []  # the committed one is untouched
    assert not (tmp_path / "superseded").exists()


# ---------------------------------------------------------------- names and files training code can plant


@pytest.mark.parametrize(
    "name",
    [
        "step_000040\n",  # a newline to forge a log line with
        "step_000040\n\x1b[2Kprogress: forged",
        "step_\u0660\u0660\u0660\u0660\u0664\u0660",  # Arabic-Indic digits: int() reads them, step_dir never writes them
        "../step_000040",
        "/elsewhere/step_000040",
        "step_000040.tmp",
        "step_00004",
    ],
)
def test_only_a_plain_step_name_is_a_checkpoint_name(tmp_path: Path, name: str) -> None:
    assert not fmt.is_step_name(name)
    if "/" not in name:  # (a path's last part may well be a plain name)
        assert fmt.step_of(tmp_path / name) is None
    assert fmt.is_step_name("step_000040") and fmt.step_of("step_1234567") == 1234567


def test_a_step_folder_that_is_a_link_is_not_a_checkpoint(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "ckpt", tmp_path / "other"
    own = make_checkpoint(root, 10)
    theirs = make_checkpoint(elsewhere, 40)
    (root / "step_000040").symlink_to(theirs, target_is_directory=True)
    assert fmt.list_checkpoints(root) == [own]
    assert fmt.latest_valid(root) == own


def test_a_manifest_that_is_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    import threading

    ckpt = make_checkpoint(tmp_path, 10)
    (ckpt / fmt.MANIFEST).unlink()
    os.mkfifo(ckpt / fmt.MANIFEST)  # nobody ever writes it: a blocking open would wait forever
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            fmt.read_manifest(ckpt)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "read_manifest waited on a FIFO"
    assert isinstance(outcome[0], CheckpointInvalid) and "not a regular file" in str(outcome[0])


@pytest.mark.parametrize(
    "plant,expected",
    [
        (lambda p: p.write_text("[" * 100_000), "not valid JSON"),  # nested past the parser's depth
        (lambda p: os.truncate(p, fmt.MANIFEST_BYTES + 1), "larger than"),  # sparse: costs no disk
        (lambda p: p.write_bytes(b'{"format": "\xff"}'), "not valid JSON"),  # not UTF-8
    ],
)
def test_a_malformed_manifest_is_invalid_never_an_exception_of_another_kind(
    tmp_path: Path, plant, expected: str
) -> None:
    ckpt = make_checkpoint(tmp_path, 10)
    plant(ckpt / fmt.MANIFEST)
    with pytest.raises(CheckpointInvalid, match=expected):
        fmt.read_manifest(ckpt)
    assert any(expected in p for p in fmt.verify(ckpt))


def test_a_superseded_folder_that_is_a_link_is_never_moved_into(tmp_path: Path) -> None:
    from trainyard.atomic import UnsafePath

    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = make_checkpoint(root, 10)
    (root / fmt.SUPERSEDED).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath):
        fmt.supersede(ckpt)
    assert fmt.verify(ckpt) == [] and list(elsewhere.iterdir()) == []


def test_a_checkpoint_swapped_for_a_link_is_superseded_as_a_link_and_its_target_stays(tmp_path: Path) -> None:
    """A rank that swaps its step folder for a link to another pipeline's checkpoint moves only the link aside:
    the rename is made between held folders, and the other pipeline's checkpoint stays whole where it was."""
    root, theirs_root = tmp_path / "ckpt", tmp_path / "theirs"
    theirs = make_checkpoint(theirs_root, 10)
    ckpt = make_checkpoint(root, 10)
    shutil.rmtree(ckpt)
    ckpt.symlink_to(theirs, target_is_directory=True)
    moved = fmt.supersede(ckpt)
    assert moved.parent == root / fmt.SUPERSEDED and moved.is_symlink()
    assert not ckpt.exists() and fmt.verify(theirs) == []

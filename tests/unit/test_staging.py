"""Local staging: verified copies, incremental re-stage, no escape from the root."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.spec import FORMAT_SUFFIXES
from trainyard.storage import LocalTier
from trainyard.storage.hot import STAGED_MANIFEST
from trainyard.storage.keys import check_key, key_path
from trainyard.storage.staged import read_staged, recorded_digest
from trainyard.storage.staging import stage
from trainyard.storage.tier import ObjectInfo


def make_source(root: Path, files: dict[str, bytes]) -> LocalTier:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return LocalTier(root)


def test_stage_copies_and_verifies(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 1000, "sub/b.tok": b"b" * 10})
    ledger = Ledger.in_dir(tmp_path / "run")
    result = stage(source, tmp_path / "hot", ledger=ledger)
    assert (result.files, result.transferred, result.bytes_transferred) == (2, 2, 1010)
    assert (tmp_path / "hot" / "sub" / "b.tok").read_bytes() == b"b" * 10
    manifest = json.loads((tmp_path / "hot" / STAGED_MANIFEST).read_text())
    assert set(manifest["files"]) == {"a.tok", "sub/b.tok"}
    assert manifest["files"]["a.tok"]["digest"].startswith("xxh3-128:")
    assert manifest["files"]["a.tok"]["check"] == "local-copy" and "sha256" not in manifest["files"]["a.tok"]
    assert [e["event"] for e in ledger.events("stage_dataset")] == ["plan", "progress", "staged"]


def test_restage_unchanged_transfers_nothing_and_changed_only(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 100, "b.tok": b"b" * 100})
    stage(source, tmp_path / "hot")
    again = stage(source, tmp_path / "hot")
    assert (again.transferred, again.bytes_transferred) == (0, 0)
    (tmp_path / "cold" / "b.tok").write_bytes(b"c" * 150)
    changed = stage(source, tmp_path / "hot")
    assert (changed.transferred, changed.bytes_transferred) == (1, 150)
    assert (tmp_path / "hot" / "b.tok").read_bytes() == b"c" * 150


def test_hot_file_damaged_is_restaged(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 100})
    stage(source, tmp_path / "hot")
    (tmp_path / "hot" / "a.tok").write_bytes(b"short")
    assert stage(source, tmp_path / "hot").transferred == 1
    assert (tmp_path / "hot" / "a.tok").read_bytes() == b"a" * 100


def test_removed_source_object_leaves_the_staged_set(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a", "b.tok": b"b"})
    stage(source, tmp_path / "hot")
    (tmp_path / "cold" / "b.tok").unlink()
    stage(source, tmp_path / "hot")
    assert not (tmp_path / "hot" / "b.tok").exists()
    assert set(json.loads((tmp_path / "hot" / STAGED_MANIFEST).read_text())["files"]) == {"a.tok"}


def test_empty_source_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "cold").mkdir()
    with pytest.raises(DataError, match="holds no objects to stage"):
        stage(LocalTier(tmp_path / "cold"), tmp_path / "hot")


def test_no_partial_file_under_its_final_name(tmp_path: Path) -> None:
    class Broken(LocalTier):
        def download(self, key, dest, expect=None, durable=True, split=True):  # the copy fails verification half-way
            from trainyard.storage.hashing import write_verified

            with (self.root / key).open("rb") as stream:
                return write_verified(stream, dest, expect_size=expect.size + 1, durable=durable)

    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 100})
    with pytest.raises(DataError, match=r"a\.tok: failed verification: 100 bytes arrived, 101 expected"):
        stage(Broken(source.root), tmp_path / "hot")
    hot = tmp_path / "hot"
    assert not (hot / "a.tok").exists() and not (hot / STAGED_MANIFEST).exists()
    # the temporary file is gone too; only bookkeeping remains, and the journal records nothing
    assert sorted(p.name for p in hot.iterdir()) == [".last_used", ".staging-journal.jsonl"]
    assert (hot / ".staging-journal.jsonl").read_text() == ""


class Untrusted(LocalTier):
    """A tier whose objects carry nothing to check: each lands as a first fetch, or against its record."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.expects: list[ObjectInfo | None] = []

    def download(self, key, dest, expect=None, durable=True, split=True):
        from trainyard.storage.checksums import FIRST_FETCH, Check
        from trainyard.storage.hashing import write_verified

        self.expects.append(expect)
        check = Check("recorded", "sha256", expect.digest, "the record") if expect and expect.digest else FIRST_FETCH
        with (self.root / key).open("rb") as stream:
            return write_verified(stream, dest, check, expect_size=expect.size if expect else None, durable=durable)


def test_first_fetches_are_said_in_the_ledger_and_refetches_checked_against_the_record(tmp_path: Path) -> None:
    source = Untrusted(make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "b.tok": b"b" * 10}).root)
    ledger = Ledger.in_dir(tmp_path / "run")
    stage(source, tmp_path / "hot", ledger=ledger)
    entry = read_staged(tmp_path / "hot")["a.tok"]
    assert (entry["check"], entry["digest"]) == ("first-fetch", "sha256:" + hashlib.sha256(b"a" * 10).hexdigest())
    [said] = [e for e in ledger.events("stage_dataset") if e["event"] == "trust_on_first_fetch"]
    assert (said["objects"], said["keys"]) == (2, ["a.tok", "b.tok"])
    assert [e.digest for e in source.expects if e] == [None, None]

    (tmp_path / "hot" / "a.tok").unlink()
    stage(source, tmp_path / "hot", ledger=ledger)
    assert source.expects[-1] is not None and source.expects[-1].digest == entry["digest"]
    assert read_staged(tmp_path / "hot")["a.tok"]["check"] == "recorded"

    manifest = json.loads((tmp_path / "hot" / STAGED_MANIFEST).read_text())
    manifest["files"]["a.tok"]["digest"] = "sha256:" + "0" * 64
    (tmp_path / "hot" / STAGED_MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "hot" / "a.tok").unlink()
    with pytest.raises(DataError, match=r"a\.tok: failed verification: the record says sha256:0{64}, the bytes give"):
        stage(source, tmp_path / "hot")
    assert not (tmp_path / "hot" / "a.tok").exists()


def test_a_manifest_from_before_digests_still_gives_the_record(tmp_path: Path) -> None:
    obj = ObjectInfo("a.tok", 10, "v1")
    assert recorded_digest({"size": 10, "version": "v1", "sha256": "ab"}, obj) == "sha256:ab"
    assert recorded_digest({"size": 10, "version": "v0", "digest": "sha256:ab"}, obj) is None  # another version
    assert recorded_digest(None, obj) is None


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a\\b", "a\x00b", "", "./a", "a//b"])
def test_escaping_keys_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(DataError, match="escape the tier root"):
        check_key(key)
    with pytest.raises(DataError):
        key_path(tmp_path, key)


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    with pytest.raises(DataError, match="resolves outside"):
        key_path(tmp_path / "root", "link/secret")


def test_large_objects_come_whole_while_every_stream_has_one_and_only_the_last_may_be_split(tmp_path: Path) -> None:
    class Recording(LocalTier):
        def __init__(self, root: Path):
            super().__init__(root)
            self.split: dict[str, bool] = {}

        def download(self, key, dest, expect=None, durable=True, split=True):
            self.split[key] = split
            return super().download(key, dest, expect, durable, split)

    mib = 1 << 20
    files = {f"big-{i}.bin": bytes([i]) * (mib * (7 - i)) for i in range(6)} | {"small.tok": b"s" * 100}
    source = Recording(make_source(tmp_path / "cold", files).root)
    stage(source, tmp_path / "hot", concurrency=4)
    # six large objects on four streams: the two largest have a stream each for their whole transfer; the last
    # four would leave streams idle as the stage ends, so they may come in ranges.
    assert {k: v for k, v in source.split.items() if k.startswith("big")} == {
        "big-0.bin": False, "big-1.bin": False, "big-2.bin": True, "big-3.bin": True, "big-4.bin": True,
        "big-5.bin": True,
    }  # fmt: skip
    assert len(read_staged(tmp_path / "hot")) == 7


PLANTED = {
    ".pins/someone": b"pinned by someone else",
    "sub/.pins/someone": b"pinned by someone else",
    ".staging-journal.jsonl": b'{"key": "a.tok", "size": 1, "version": "forged", "digest": "sha256:00"}\n',
    "sub/_staged.json": json.dumps({"files": {"b.tok": {"size": 10, "version": "v"}}}).encode(),
    ".last_used": b"",
}


def test_source_objects_named_like_the_hot_tiers_own_files_are_never_staged(tmp_path: Path, caplog) -> None:
    """Issue 29: someone else's ``.pins/...``, ``.staging-journal.jsonl`` or ``sub/_staged.json`` in the
    source would pin the dataset for days, force re-stages or fake a nested dataset; at any depth."""
    from trainyard.storage.hot import staged_datasets

    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 100, "sub/b.tok": b"b" * 10, **PLANTED})
    ledger = Ledger.in_dir(tmp_path / "run")
    hot = tmp_path / "hot" / "tokens"
    result = stage(source, hot, ledger=ledger)
    assert (result.files, result.transferred) == (2, 2)
    for key in PLANTED:
        assert not key_path(hot, key).exists() or key == ".last_used", key  # .last_used: staging's own touch
        assert key in caplog.text
    assert set(read_staged(hot)) == {"a.tok", "sub/b.tok"}
    [found] = staged_datasets(tmp_path / "hot")  # no nested dataset faked, no pin held
    assert found.path == hot and found.pinned_by == ()
    assert stage(source, hot).transferred == 0  # no forged journal line, no reserved key re-copied
    [staged] = ledger.events("stage_dataset", "staged")
    assert staged["reserved_skipped"] == sorted(PLANTED)


@pytest.mark.parametrize(
    ("format_", "picked"),
    [
        ("numpy", {"train.bin", "val.bin", "part/a.npy"}),
        ("parquet", {"part-00000.parquet", "part/part-00001.parquet"}),
        ("jsonl", {"docs.jsonl"}),
    ],
)
def test_a_format_stages_only_its_own_files(tmp_path: Path, format_: str, picked: set[str]) -> None:
    files = {
        key: key.encode()
        for key in (
            "train.bin", "val.bin", "part/a.npy", "meta.pkl", "_SUCCESS", "part-00000.parquet",
            "part/part-00001.parquet", ".part-00000.parquet.crc", "docs.jsonl", "docs.jsonl.gz", "README.md",
        )
    }  # fmt: skip
    source = make_source(tmp_path / "cold", files)
    result = stage(source, tmp_path / "hot", suffixes=FORMAT_SUFFIXES[format_])  # type: ignore[index]
    assert result.files == len(picked)
    assert set(read_staged(tmp_path / "hot")) == picked
    on_disk = {str(p.relative_to(tmp_path / "hot")) for p in (tmp_path / "hot").rglob("*") if p.is_file()}
    assert {key for key in on_disk if not key.startswith(("_", "."))} == picked  # not the hot folder's own files
    # Without suffixes (the tok format) everything under the prefix is staged, as before formats existed.
    assert stage(source, tmp_path / "all").files == len(files)


def test_a_changed_format_leaves_the_other_files_behind(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.bin": b"\0\1" * 8, "b.jsonl": b'{"text": "x"}\n'})
    stage(source, tmp_path / "hot", suffixes=(".jsonl",))
    assert stage(source, tmp_path / "hot", suffixes=(".bin", ".npy")).transferred == 1
    assert set(read_staged(tmp_path / "hot")) == {"a.bin"} and not (tmp_path / "hot" / "b.jsonl").exists()


def test_no_file_of_the_format_names_the_suffixes_and_the_field(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"x", "meta.pkl": b"y"})
    with pytest.raises(DataError, match=r"holds no objects with a \.bin/\.npy suffix to stage; check dataset\.source"
                       r" and dataset\.format"):  # fmt: skip
        stage(source, tmp_path / "hot", suffixes=(".bin", ".npy"))

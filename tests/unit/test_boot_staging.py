"""Staging without fsyncs: the boot id decides what a manifest or journal line is still worth.

Each test points ``storage.boot.BOOT_ID_FILE`` at a file of its own and writes
a boot id into it; rewriting that file is a reboot.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zlib
from pathlib import Path

import pytest

from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.storage import LocalTier, boot
from trainyard.storage.checksums import FIRST_FETCH
from trainyard.storage.hashing import copy_file_verified, write_verified
from trainyard.storage.hot import JOURNAL, STAGED_MANIFEST
from trainyard.storage.staging import stage
from trainyard.storage.tier import Landed, ObjectInfo


@pytest.fixture
def booted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``booted("A")`` makes "A" this machine's boot id."""
    path = tmp_path / "boot_id"
    monkeypatch.setattr(boot, "BOOT_ID_FILE", path)

    def set_boot(value: str | None) -> None:
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(value + "\n")

    return set_boot


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every descriptor ``os.fsync`` is called on."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def make_source(root: Path, files: dict[str, bytes]) -> LocalTier:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return LocalTier(root)


def manifest(hot: Path) -> dict:
    return json.loads((hot / STAGED_MANIFEST).read_text())


# ------------------------------------------------------------------ durable or not


def test_durable_false_skips_the_fsync_and_the_default_keeps_it(tmp_path: Path, fsyncs: list[str]) -> None:
    (tmp_path / "src").write_bytes(b"x" * 5000)
    copy_file_verified(tmp_path / "src", tmp_path / "fast", durable=False)
    with (tmp_path / "src").open("rb") as stream:
        write_verified(stream, tmp_path / "fast2", FIRST_FETCH, durable=False)
    landed = LocalTier(tmp_path).download("src", tmp_path / "fast3", ObjectInfo("src", 5000, "v"), durable=False)
    assert fsyncs == [] and landed == Landed(5000, landed.digest, "local-copy")
    assert (tmp_path / "fast").read_bytes() == (tmp_path / "fast2").read_bytes() == b"x" * 5000
    copy_file_verified(tmp_path / "src", tmp_path / "slow")
    with (tmp_path / "src").open("rb") as stream:
        write_verified(stream, tmp_path / "slow2", FIRST_FETCH)
    LocalTier(tmp_path).download("src", tmp_path / "slow3")
    assert len(fsyncs) == 3 and all(".part-" in p for p in fsyncs)  # each temporary copy, before its rename


def test_with_a_boot_id_staging_fsyncs_no_copy_and_records_the_boot(tmp_path: Path, booted, fsyncs: list[str]) -> None:
    booted("boot-A")
    hot = tmp_path / "hot"
    stage(make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "s/b.tok": b"b" * 20}), hot)
    assert manifest(hot)["boot_id"] == "boot-A"
    assert not [p for p in fsyncs if "tok" in p or p == str(hot / "s")]  # no copy, no folder of copies
    assert (hot / "s" / "b.tok").read_bytes() == b"b" * 20


def test_without_a_boot_id_staging_fsyncs_each_copy_and_records_no_boot(
    tmp_path: Path, booted, fsyncs: list[str]
) -> None:
    booted(None)
    hot = tmp_path / "hot"
    stage(make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "s/b.tok": b"b" * 20}), hot)
    assert "boot_id" not in manifest(hot)
    assert len([p for p in fsyncs if ".tok.part-" in p]) == 2 and str(hot / "s") in fsyncs


# ------------------------------------------------------------------ staging across a reboot


def test_a_manifest_from_another_boot_is_staged_again_and_its_stale_files_removed(
    tmp_path: Path, booted, caplog: pytest.LogCaptureFixture
) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "b.tok": b"b" * 10, "gone.tok": b"g"})
    hot = tmp_path / "hot"
    booted("boot-A")
    assert stage(source, hot).transferred == 3
    assert stage(source, hot).transferred == 0  # the same boot: unchanged files are skipped
    (tmp_path / "cold" / "gone.tok").unlink()
    booted("boot-B")  # a reboot
    ledger = Ledger.in_dir(tmp_path / "run")
    assert stage(source, hot, ledger=ledger).transferred == 2
    [said] = [e for e in ledger.events("stage_dataset") if e["event"] == "earlier_boot"]
    assert (said["objects"], said["manifest_objects"], said["keys"]) == (3, 3, ["a.tok", "b.tok", "gone.tok"])
    assert "staged in an earlier boot" in caplog.text
    assert not (hot / "gone.tok").exists()  # the untrusted manifest's keys still say what to clean up
    assert manifest(hot)["boot_id"] == "boot-B" and set(manifest(hot)["files"]) == {"a.tok", "b.tok"}
    assert stage(source, hot).transferred == 0


def test_a_manifest_without_a_boot_id_stays_trusted(tmp_path: Path, booted) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 10})
    booted(None)  # written by staging that fsynced each copy
    stage(source, tmp_path / "hot")
    booted("boot-B")
    assert stage(source, tmp_path / "hot").transferred == 0


def test_a_boot_less_manifest_says_this_boot_before_unsynced_copies_replace_its_files(tmp_path: Path, booted) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "b.tok": b"b" * 10})
    hot = tmp_path / "hot"
    booted(None)
    stage(source, hot)  # fsynced: trusted in any boot
    (tmp_path / "cold" / "a.tok").write_bytes(b"A" * 11)
    seen: list[object] = []

    class Watching(LocalTier):
        def download(
            self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
        ) -> Landed:
            seen.append(manifest(hot).get("boot_id"))  # what a crash right now would leave
            return super().download(key, dest, expect, durable=durable, split=split)

    booted("boot-A")
    assert stage(Watching(source.root), hot).transferred == 1
    assert seen == ["boot-A"]


def test_a_journal_line_from_another_boot_is_not_trusted(tmp_path: Path, booted) -> None:
    source = make_source(tmp_path / "cold", {f"{k}.tok": k.encode() * 100 for k in "abcde"})

    class FailsOnC(LocalTier):
        def download(
            self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
        ) -> Landed:
            if key == "c.tok":
                raise OSError("disk hiccup on c.tok")
            return super().download(key, dest, expect, durable=durable, split=split)

    hot = tmp_path / "hot"
    booted("boot-A")
    with pytest.raises(OSError, match="disk hiccup"):
        stage(FailsOnC(source.root), hot, concurrency=1)
    lines = [json.loads(line) for line in (hot / JOURNAL).read_text().splitlines()]
    assert lines and all(rec["boot_id"] == "boot-A" for rec in lines)
    booted("boot-B")
    ledger = Ledger.in_dir(tmp_path / "run")
    assert stage(source, hot, ledger=ledger).transferred == 5  # the journaled ones too
    [said] = [e for e in ledger.events("stage_dataset") if e["event"] == "earlier_boot"]
    assert (said["objects"], said["manifest_objects"]) == (len(lines), 0)
    assert "boot_id" not in manifest(hot)["files"]["a.tok"]


def test_a_journal_line_from_this_boot_is_trusted(tmp_path: Path, booted) -> None:
    source = make_source(tmp_path / "cold", {f"{k}.tok": k.encode() * 100 for k in "abcde"})

    class FailsOnC(LocalTier):
        def download(
            self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
        ) -> Landed:
            if key == "c.tok":
                raise OSError("disk hiccup on c.tok")
            return super().download(key, dest, expect, durable=durable, split=split)

    booted("boot-A")
    with pytest.raises(OSError, match="disk hiccup"):
        stage(FailsOnC(source.root), tmp_path / "hot", concurrency=1)
    journaled = len((tmp_path / "hot" / JOURNAL).read_text().splitlines())
    assert stage(source, tmp_path / "hot").transferred == 5 - journaled


# ------------------------------------------------------------------ the orchestrator's re-verify


def staged_in_boot_a(tmp_path: Path, booted) -> Path:
    hot = tmp_path / "hot"
    booted("boot-A")
    stage(make_source(tmp_path / "cold", {"a.tok": b"a" * 1000, "s/b.tok": b"b" * 1000}), hot)
    booted("boot-B")
    return hot


def test_reverify_passes_on_intact_files_and_restamps_the_manifest(tmp_path: Path, booted) -> None:
    hot = staged_in_boot_a(tmp_path, booted)
    ledger = Ledger.in_dir(tmp_path / "run")
    assert boot.ensure_this_boot(hot, ledger) == 2
    assert manifest(hot)["boot_id"] == "boot-B"
    [said] = [e for e in ledger.events("check_dataset") if e["event"] == "earlier_boot_reverified"]
    assert (said["files"], said["mismatched"]) == (2, [])
    assert boot.ensure_this_boot(hot, ledger) == 0  # once per boot


def test_reverify_refuses_a_file_a_crash_took_back(tmp_path: Path, booted) -> None:
    hot = staged_in_boot_a(tmp_path, booted)
    (hot / "s" / "b.tok").write_bytes(b"\0" * 1000)  # same size: the lost page cache left zeros
    with pytest.raises(DataError, match=r"s/b\.tok \(xxh3-128:.*clear stage_dataset in the Airflow UI") as err:
        boot.ensure_this_boot(hot)
    assert "a.tok" not in str(err.value)
    assert manifest(hot)["boot_id"] == "boot-A"  # not re-stamped: it stays untrusted


def test_reverify_recomputes_each_recorded_algorithm_and_refuses_part_checksums(tmp_path: Path, booted) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    data = b"shard" * 300
    for name in ("s.tok", "m.tok", "c.tok", "p.tok"):
        (hot / name).write_bytes(data)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    files = {
        "s.tok": {"size": len(data), "digest": f"sha256:{hashlib.sha256(data).hexdigest()}"},
        "m.tok": {"size": len(data), "digest": f"md5:{hashlib.md5(data).hexdigest()}"},
        "c.tok": {"size": len(data), "digest": f"crc32:{crc}"},
        "p.tok": {"size": len(data), "digest": "md5-multipart:0123456789abcdef0123456789abcdef-2"},
    }
    if "crc32" not in boot.checksums.available_algorithms():
        del files["c.tok"]
    booted("boot-B")
    (hot / STAGED_MANIFEST).write_text(json.dumps({"files": files, "boot_id": "boot-A"}))
    with pytest.raises(DataError, match=r"1 of its \d files no longer match") as err:
        boot.ensure_this_boot(hot)
    assert "p.tok (its digest md5-multipart:" in str(err.value) and "cannot be recomputed" in str(err.value)
    del files["p.tok"]
    (hot / STAGED_MANIFEST).write_text(json.dumps({"files": files, "boot_id": "boot-A"}))
    assert boot.ensure_this_boot(hot) == len(files)


def test_trusted_is_the_same_boot_or_none_recorded() -> None:
    assert boot.trusted(None, "B") and boot.trusted("B", "B") and boot.trusted(None, None)
    assert not boot.trusted("A", "B") and not boot.trusted("A", None)


# ------------------------------------------------------------------ wired before check_dataset and train

SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {{count: 1}}
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
training: {{max_steps: 4, global_batch: 8, micro_batch: 2, checkpoint_every: 2}}
"""


def test_check_dataset_and_training_refuse_a_folder_a_reboot_damaged(tmp_path: Path, booted) -> None:
    write_synthetic_corpus(tmp_path / "cold", shards=2, tokens_per_shard=1024)
    (tmp_path / "spec.yaml").write_text(SPEC.format(root=tmp_path))
    run = open_run(tmp_path / "spec.yaml", "boot_dag", "manual__1", "2026-12-01")
    booted("boot-A")
    stages.stage_dataset(run)
    booted("boot-B")
    [shard] = [p for p in sorted(run.hot_dataset_dir.iterdir()) if p.suffix == ".tok"][:1]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    with pytest.raises(DataError, match=rf"{shard.name} \(xxh3-128:"):
        stages.check_dataset(run)
    with pytest.raises(DataError, match=rf"{shard.name} \(xxh3-128:"):
        stages.TrainStage(run, ["node-1"], launcher=None).begin()  # type: ignore[arg-type]
    failed = [e for e in run.ledger.events() if e["event"] == "stage_failed"]
    assert [e["stage"] for e in failed] == ["check_dataset", "train"]

"""Local -> local copies: one pass, hashed while copying (xxh3-128), durable before they are named."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import xxhash

from trainyard.atomic import is_temp_name
from trainyard.errors import DataError
from trainyard.storage import LocalTier, boot, hashing
from trainyard.storage import transfer as transfer_mod
from trainyard.storage.hashing import copy_file_verified
from trainyard.storage.hot import JOURNAL, STAGED_MANIFEST
from trainyard.storage.staging import stage
from trainyard.storage.tier import Landed, ObjectInfo
from trainyard.storage.transfer import concurrency_for

SIZE = 3 * hashing.COPY_BLOCK + 17  # several blocks and a short last one


def xxh(data: bytes) -> str:
    return f"xxh3-128:{xxhash.xxh3_128(data).hexdigest()}"


def test_copy_lands_the_same_bytes_with_their_xxh3_digest(tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    (tmp_path / "src.bin").write_bytes(data)
    size, digest = copy_file_verified(tmp_path / "src.bin", tmp_path / "out" / "dst.bin")
    assert (size, digest) == (SIZE, xxh(data))
    assert (tmp_path / "out" / "dst.bin").read_bytes() == data
    assert os.listdir(tmp_path / "out") == ["dst.bin"]  # no temporary left beside it


def test_empty_file_copies(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"")
    assert copy_file_verified(tmp_path / "src", tmp_path / "dst") == (0, xxh(b""))
    assert (tmp_path / "dst").read_bytes() == b""


def test_local_tier_download_says_how_it_checked(tmp_path: Path) -> None:
    (tmp_path / "cold" / "d").mkdir(parents=True)
    (tmp_path / "cold" / "d" / "a.tok").write_bytes(b"abc" * 1000)
    tier = LocalTier(tmp_path / "cold")
    [obj] = tier.list()
    landed = tier.download(obj.key, tmp_path / "hot" / obj.key, obj)
    assert landed == Landed(3000, xxh(b"abc" * 1000), "local-copy")


def test_a_recorded_digest_is_checked_with_its_own_algorithm(tmp_path: Path) -> None:
    data = b"payload" * 500
    (tmp_path / "cold").mkdir()
    (tmp_path / "cold" / "a").write_bytes(data)
    tier = LocalTier(tmp_path / "cold")
    sha = hashlib.sha256(data).hexdigest()
    info = ObjectInfo("a", len(data), "v", digest=f"sha256:{sha}")
    assert tier.download("a", tmp_path / "hot" / "a", info) == Landed(len(data), f"sha256:{sha}", "local-copy")
    wrong = ObjectInfo("a", len(data), "v", digest=xxh(b"something else"))
    with pytest.raises(OSError, match="failed verification: xxh3-128 of the copy != expected"):
        tier.download("a", tmp_path / "hot2" / "a", wrong)
    assert os.listdir(tmp_path / "hot2") == []  # refused: nothing under the final name, no temporary


def test_size_other_than_listed_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * 100)
    with pytest.raises(OSError, match=r"failed verification: size 100 != expected 99"):
        copy_file_verified(tmp_path / "src", tmp_path / "out" / "dst", expect_size=99)
    assert os.listdir(tmp_path / "out") == []


class Spy:
    """A real xxh3 hasher that runs ``hook`` before its first update (mid-copy, the temporary open)."""

    def __init__(self, hook: Any):
        self.inner, self.hook, self.calls = xxhash.xxh3_128(), hook, 0

    def update(self, data: memoryview) -> None:
        if self.calls == 0:
            self.hook()
        self.calls += 1
        self.inner.update(data)

    def digest(self) -> bytes:
        return self.inner.digest()


def test_the_copy_is_never_visible_under_its_final_name_until_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(hashing, "new_hasher", lambda algo: Spy(lambda: seen.append(os.listdir(tmp_path / "out"))))
    (tmp_path / "src").write_bytes(os.urandom(SIZE))
    copy_file_verified(tmp_path / "src", tmp_path / "out" / "dst")
    [names] = seen
    assert len(names) == 1 and is_temp_name(names[0])  # mid-copy: only a hidden temporary name


def test_fsync_comes_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b))[1])
    (tmp_path / "src").write_bytes(b"data")
    copy_file_verified(tmp_path / "src", tmp_path / "dst")
    assert events == ["fsync", "rename"]


def test_a_source_written_during_the_copy_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(SIZE))

    def writer_appends() -> None:
        with src.open("ab") as fh:
            fh.write(b"more")

    monkeypatch.setattr(hashing, "new_hasher", lambda algo: Spy(writer_appends))
    with pytest.raises(OSError, match=r"refused: .*src changed during the copy"):
        copy_file_verified(src, tmp_path / "out" / "dst")
    assert os.listdir(tmp_path / "out") == []  # neither the copy nor its temporary


def test_a_source_rewritten_in_place_during_the_copy_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"a" * SIZE)

    def writer_rewrites() -> None:  # same size, new bytes: only the modification time tells
        with src.open("r+b") as fh:
            fh.seek(SIZE - 10)
            fh.write(b"b" * 10)
        st = src.stat()
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse clocks: a visibly later mtime

    monkeypatch.setattr(hashing, "new_hasher", lambda algo: Spy(writer_rewrites))
    with pytest.raises(OSError, match="changed during the copy"):
        copy_file_verified(src, tmp_path / "out" / "dst")
    assert os.listdir(tmp_path / "out") == []


def test_parallel_copies_each_get_their_own_digest(tmp_path: Path) -> None:
    blobs = {f"f{i:02d}": os.urandom(hashing.COPY_BLOCK + i * 4099) for i in range(24)}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    with ThreadPoolExecutor(8) as pool:
        results = dict(
            zip(blobs, pool.map(lambda n: copy_file_verified(tmp_path / n, tmp_path / "out" / n), blobs), strict=True)
        )
    for name, data in blobs.items():
        assert results[name] == (len(data), xxh(data))
        assert (tmp_path / "out" / name).read_bytes() == data


def test_upload_keeps_sha256_for_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"weights" * 100)
    size, sha = LocalTier(tmp_path / "cold").upload(tmp_path / "f", "ckpt/f")
    assert (size, sha) == (700, hashlib.sha256(b"weights" * 100).hexdigest())
    assert (tmp_path / "cold" / "ckpt" / "f").read_bytes() == b"weights" * 100


# ------------------------------------------------------------------ staging with local copies


def make_source(root: Path, files: dict[str, bytes]) -> LocalTier:
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return LocalTier(root)


def test_the_manifest_records_the_digest_and_how_it_was_checked(tmp_path: Path) -> None:
    stage(make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "s/b.tok": b"b" * 20}), tmp_path / "hot")
    files = json.loads((tmp_path / "hot" / STAGED_MANIFEST).read_text())["files"]
    assert files["s/b.tok"]["digest"] == xxh(b"b" * 20) and files["s/b.tok"]["check"] == "local-copy"
    assert "sha256" not in files["a.tok"]  # only a sha256 digest is also written as "sha256"
    assert files["a.tok"]["size"] == 10 and files["a.tok"]["version"].startswith("10-")


def test_every_folder_is_fsynced_before_the_manifest_names_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boot, "BOOT_ID_FILE", tmp_path / "no-boot-id")  # no boot to record: staging fsyncs
    hot = tmp_path / "hot"
    synced: list[tuple[Path, bool]] = []
    real = transfer_mod.fsync_dir
    monkeypatch.setattr(
        transfer_mod, "fsync_dir", lambda d: (synced.append((d, (hot / STAGED_MANIFEST).exists())), real(d))[1]
    )
    stage(make_source(tmp_path / "cold", {"a.tok": b"a", "s/b.tok": b"b", "s/t/c.tok": b"c"}), hot)
    assert {d for d, _ in synced} == {hot, hot / "s", hot / "s" / "t"}
    assert not any(manifest_there for _, manifest_there in synced)


def test_objects_finished_before_a_failure_are_journaled_and_skipped_on_rerun(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {f"{k}.tok": k.encode() * 100 for k in "abcde"})

    class FailsOnC(LocalTier):
        def download(
            self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
        ) -> Landed:
            if key == "c.tok":
                raise OSError("disk hiccup on c.tok")
            return super().download(key, dest, expect, durable, split)

    with pytest.raises(OSError, match="disk hiccup"):
        stage(FailsOnC(source.root), tmp_path / "hot", concurrency=8)
    lines = [json.loads(line) for line in (tmp_path / "hot" / JOURNAL).read_text().splitlines()]
    assert {rec["key"] for rec in lines} <= {"a.tok", "b.tok", "d.tok", "e.tok"}
    assert all(rec["check"] == "local-copy" and rec["digest"].startswith("xxh3-128:") for rec in lines)
    again = stage(source, tmp_path / "hot")
    assert again.transferred == 5 - len(lines)
    assert (tmp_path / "hot" / "c.tok").read_bytes() == b"c" * 100


def test_a_hot_file_replaced_by_a_link_is_staged_again(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"a.tok": b"a" * 10, "b.tok": b"b" * 10})
    hot = tmp_path / "hot"
    stage(source, hot)
    (hot / "a.tok").unlink()
    (hot / "a.tok").symlink_to(hot / "b.tok")  # same size, other content
    assert stage(source, hot).transferred == 1
    assert not (hot / "a.tok").is_symlink() and (hot / "a.tok").read_bytes() == b"a" * 10


def test_small_objects_get_more_threads_than_large_ones() -> None:
    small = [ObjectInfo(f"s{i}", 4096, "v") for i in range(100)]
    large = [ObjectInfo(f"l{i}", 64 << 20, "v") for i in range(10)]
    assert concurrency_for(small, 4) == (0, 16)
    assert concurrency_for(large + small, 4) == (4, 16)
    assert concurrency_for(large + small[:3], 32) == (10, 3)  # never more threads than objects
    assert concurrency_for(small, 40) == (0, 64)  # nor more than 64 connections' worth
    assert concurrency_for(large + small, 1) == (1, 1)  # one at a time stays one at a time


def test_many_small_objects_are_in_flight_at_once(tmp_path: Path) -> None:
    # Each download waits until 12 are running together: with only ``concurrency`` (4) threads the
    # barrier would break (BrokenBarrierError) instead of the stage finishing.
    barrier = threading.Barrier(12, timeout=20)
    source = make_source(tmp_path / "cold", {f"o{i:03d}.tok": b"x" * 4096 for i in range(48)})

    class Meeting(LocalTier):
        def download(
            self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
        ) -> Landed:
            barrier.wait()
            return super().download(key, dest, expect, durable, split)

    result = stage(Meeting(source.root), tmp_path / "hot", concurrency=4)
    assert result.transferred == 48


def test_a_hot_folder_replaced_by_a_link_out_of_the_hot_tier_is_refused(tmp_path: Path) -> None:
    source = make_source(tmp_path / "cold", {"s/a.tok": b"a" * 10})
    hot = tmp_path / "hot"
    stage(source, hot)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.tok").write_bytes(b"z" * 10)  # same size: only the link tells
    (hot / "s" / "a.tok").unlink()
    (hot / "s").rmdir()
    (hot / "s").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="resolves outside"):
        stage(source, hot)
    assert (tmp_path / "elsewhere" / "a.tok").read_bytes() == b"z" * 10  # nothing written through it
